"""Distributed weight sync overhead: ``DistributedWeightSync.push`` vs a raw broadcast of the same bytes.

One trainer (this process, rank 0) and one receiver process (rank 1, the server side of the
protocol, ``omni_grpo.testing.sync``) on this machine. Source: a synthetic pseudo-VL text model
(fused experts in transformers' in-memory layout, bf16) of about ``--mb`` MiB. Measured in the
same run, same receiver code, same bucket composition:

- ``baseline_raw_broadcast``: the tensors already in server layout, one broadcast per tensor per
  bucket, no HTTP, no renaming/transposing (what the wire alone costs);
- ``ours``: ``push`` through the fake sglang-omni server over loopback HTTP (pause, one
  ``update_weights_from_distributed`` per bucket concurrently with the broadcasts, continue,
  ``/model_info`` verify), including the name map and the expert transposes.

Backend: NCCL between GPU 0 and 1 when two GPUs exist (``--backend nccl``), else gloo on CPU. Prints
one JSON object; ``ratio`` = ours bandwidth / baseline bandwidth (issue 8 target: >= 0.8).

    uv run python benchmarks/weight_sync.py [--mb 256] [--bucket-mb 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import tempfile
import time
from pathlib import Path

import torch


def synthetic_state(mb: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Qwen3-MoE-shaped layers (hidden 1024, 16 experts of 512) until ~``mb`` MiB."""
    h, inter, e, heads, kv, hd, vocab = 1024, 512, 16, 8, 2, 128, 32000
    g = torch.Generator().manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(dtype)

    state = {
        "model.language_model.embed_tokens.weight": rnd(vocab, h),
        "lm_head.weight": rnd(vocab, h),
        "model.language_model.norm.weight": rnd(h),
    }
    layer = 0
    while sum(t.numel() * t.element_size() for t in state.values()) < mb << 20:
        p = f"model.language_model.layers.{layer}."
        state |= {
            p + "input_layernorm.weight": rnd(h),
            p + "post_attention_layernorm.weight": rnd(h),
            p + "self_attn.q_proj.weight": rnd(heads * hd, h),
            p + "self_attn.k_proj.weight": rnd(kv * hd, h),
            p + "self_attn.v_proj.weight": rnd(kv * hd, h),
            p + "self_attn.o_proj.weight": rnd(h, heads * hd),
            p + "self_attn.q_norm.weight": rnd(hd),
            p + "self_attn.k_norm.weight": rnd(hd),
            p + "mlp.gate.weight": rnd(e, h),
            p + "mlp.experts.gate_up_proj": rnd(e, 2 * inter, h),  # in-memory [E, 2I, H]
            p + "mlp.experts.down_proj": rnd(e, h, inter),  # in-memory [E, H, I]
        }
        layer += 1
    return state


def raw_broadcast(
    server_tensors: list[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    backend: str,
    device: str,
    out: Path,
) -> float:
    """Seconds to broadcast every bucket to one receiver with no HTTP and no conversion."""
    from omni_grpo.sync.buckets import buckets
    from omni_grpo.sync.group import build_group, host_store
    from omni_grpo.testing.sync import receiver_main

    ctx = mp.get_context("forkserver")
    store = host_store("127.0.0.1", 2, 300)
    inbox = ctx.Queue()
    proc = ctx.Process(
        target=receiver_main,
        args=(inbox, str(out), 1, 2, "127.0.0.1", store.port, "raw", backend, False),
        daemon=True,
    )
    proc.start()
    group = build_group(
        store, group_name="raw", world_size=2, rank=0, backend=backend, timeout_s=300
    )
    bucket_list = list(buckets([(n, t.to(device)) for n, t in server_tensors], bucket_bytes))
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    for b in bucket_list:
        inbox.put((b.names, b.dtypes, b.shapes))
        for w in [group.broadcast(t) for t in b.tensors]:
            w.wait()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    inbox.put(None)
    proc.join(60)
    group.destroy()
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--backend",
        choices=["gloo", "nccl"],
        default="nccl" if torch.cuda.device_count() >= 2 else "gloo",
    )
    args = ap.parse_args()

    from omni_extract.names import to_server_tensors
    from omni_grpo.config import SglangOmniConfig
    from omni_grpo.sync import make_weight_sync
    from omni_grpo.testing.sync import ServerSideReceivers
    from omni_rollout_client.testing import FakeOmniServer

    mp.get_context("forkserver").set_forkserver_preload(["torch", "omni_grpo.testing.sync"])
    device = "cuda:0" if args.backend == "nccl" else "cpu"
    state = {k: v.to(device) for k, v in synthetic_state(args.mb, torch.bfloat16).items()}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    bucket_bytes = args.bucket_mb << 20
    server_tensors = list(to_server_tensors(state.items(), "hf_memory"))

    with tempfile.TemporaryDirectory() as tmp:
        raw = [
            raw_broadcast(server_tensors, bucket_bytes, args.backend, device, Path(tmp) / f"raw{i}")
            for i in range(args.repeats)
        ]
        ours = []
        with (
            FakeOmniServer() as server,
            ServerSideReceivers([server], Path(tmp) / "recv", args.backend, save=False) as rx,
        ):
            sync = make_weight_sync(
                SglangOmniConfig(urls=[server.url], sync_mode="distributed"),
                run_dir=Path(tmp),
                backend=args.backend,
                bucket_bytes=bucket_bytes,
            )
            try:
                sync.push(state, "warmup")  # group setup (once per run) is not a per-step cost
                for i in range(args.repeats):
                    start = time.perf_counter()
                    report = sync.push(state, f"v{i}")
                    ours.append(time.perf_counter() - start)
            finally:
                sync.close()
        assert not rx.errors, rx.errors
    best_raw, best_ours = min(raw), min(ours)
    print(
        json.dumps(
            {
                "backend": args.backend,
                "bytes": nbytes,
                "tensors": report.tensors,
                "buckets": report.buckets,
                "bucket_mb": args.bucket_mb,
                "baseline_raw_broadcast_s": best_raw,
                "baseline_raw_broadcast_gbps": nbytes / best_raw / 1e9,
                "ours_push_s": best_ours,
                "ours_push_gbps": nbytes / best_ours / 1e9,
                "ratio": best_raw / best_ours,
                "repeats": args.repeats,
            }
        )
    )


if __name__ == "__main__":
    main()
