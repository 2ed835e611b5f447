"""Distributed weight sync overhead: ``DistributedWeightSync.push`` vs a raw broadcast of the same bytes.

A synthetic pseudo-VL text model of ``--mb`` MiB into one receiver process: docs/benchmarks.md,
"Methods". ``ratio`` = ours / baseline bandwidth (issue 8 target: >= 0.8), best of each.

    uv run python benchmarks/weight_sync.py [--mb 256] [--bucket-mb 64] [--repeats 3]
"""

import multiprocessing as mp
import tempfile
from functools import partial
from pathlib import Path

import harness
import torch
from omni_extract.names import to_server_tensors
from omni_grpo.config import SglangOmniConfig
from omni_grpo.sync import make_weight_sync
from omni_grpo.sync.buckets import buckets
from omni_grpo.sync.group import build_group, host_store
from omni_grpo.testing.sync import ServerSideReceivers, receiver_main
from omni_rollout_client.testing import FakeOmniServer


def raw_broadcast(tensors: list, bucket_bytes: int, backend: str, device: str, out: Path) -> float:
    """Seconds to broadcast every bucket to one receiver with no HTTP and no conversion."""
    ctx = mp.get_context("forkserver")
    store = host_store("127.0.0.1", 2, 300)
    inbox = ctx.Queue()
    rx_args = (inbox, str(out), 1, 2, "127.0.0.1", store.port, "raw", backend, False)
    proc = ctx.Process(target=receiver_main, args=rx_args, daemon=True)
    proc.start()
    kw = {"group_name": "raw", "world_size": 2, "rank": 0, "backend": backend, "timeout_s": 300}
    group = build_group(store, **kw)
    bucket_list = list(buckets([(n, t.to(device)) for n, t in tensors], bucket_bytes))
    with harness.timed(device) as t:
        for b in bucket_list:
            inbox.put((b.names, b.dtypes, b.shapes))
            for w in [group.broadcast(x) for x in b.tensors]:
                w.wait()
    inbox.put(None)
    proc.join(60)
    group.destroy()
    return t.s


if __name__ == "__main__":
    backends = ("nccl", "gloo") if torch.cuda.device_count() >= 2 else ("gloo", "nccl")
    args = harness.parser(__doc__, mb=256, bucket_mb=64, repeats=3, backend=backends).parse_args()
    mp.get_context("forkserver").set_forkserver_preload(["torch", "omni_grpo.testing.sync"])
    device = "cuda:0" if args.backend == "nccl" else "cpu"
    # Qwen3-MoE-shaped layers (hidden 1024, 16 experts of 512) until ~--mb MiB
    h, inter, e, heads, kv, hd, vocab = 1024, 512, 16, 8, 2, 128, 32000
    g = torch.Generator().manual_seed(0)
    shapes = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,)}
    shapes |= {"self_attn.q_proj.weight": (heads * hd, h), "self_attn.k_proj.weight": (kv * hd, h)}
    shapes |= {"self_attn.v_proj.weight": (kv * hd, h), "self_attn.o_proj.weight": (h, heads * hd)}
    shapes |= {"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)}
    shapes |= {"mlp.gate.weight": (e, h), "mlp.experts.gate_up_proj": (e, 2 * inter, h)}
    shapes["mlp.experts.down_proj"] = (e, h, inter)  # memory layout: [E, 2I, H], [E, H, I]
    lm = "model.language_model."
    top = {lm + "embed_tokens.weight": (vocab, h), "lm_head.weight": (vocab, h)}
    top[lm + "norm.weight"] = (h,)
    state = {k: (torch.randn(*s, generator=g) * 0.02).bfloat16() for k, s in top.items()}
    layer = 0
    while harness.nbytes(state.values()) < args.mb << 20:
        for k, s in shapes.items():
            state[f"{lm}layers.{layer}.{k}"] = (torch.randn(*s, generator=g) * 0.02).bfloat16()
        layer += 1
    state = {k: v.to(device) for k, v in state.items()}
    nbytes, bucket_bytes = harness.nbytes(state.values()), args.bucket_mb << 20
    server_tensors = list(to_server_tensors(state.items(), "hf_memory"))
    with tempfile.TemporaryDirectory() as tmp:
        broadcast = partial(raw_broadcast, server_tensors, bucket_bytes, args.backend, device)
        raw, ours = [broadcast(Path(tmp) / f"raw{i}") for i in range(args.repeats)], []
        with (
            FakeOmniServer() as server,
            ServerSideReceivers([server], Path(tmp) / "recv", args.backend, save=False) as rx,
        ):
            cfg = SglangOmniConfig(urls=[server.url], sync_mode="distributed")
            kw = {"run_dir": Path(tmp), "backend": args.backend, "bucket_bytes": bucket_bytes}
            sync = make_weight_sync(cfg, **kw)
            try:
                sync.push(state, "warmup")  # group setup (once per run) is not a per-step cost
                for i in range(args.repeats):
                    with harness.timed() as t:
                        report = sync.push(state, f"v{i}")
                    ours.append(t.s)
            finally:
                sync.close()
        assert not rx.errors, rx.errors
    best_raw, best_ours = min(raw), min(ours)
    record = {"backend": args.backend, "bytes": nbytes, "tensors": report.tensors}
    record |= {"buckets": report.buckets, "bucket_mb": args.bucket_mb}
    record |= {"baseline_raw_broadcast_s": best_raw}
    record |= {"baseline_raw_broadcast_gbps": nbytes / best_raw / 1e9, "ours_push_s": best_ours}
    record |= {"ours_push_gbps": nbytes / best_ours / 1e9, "ratio": best_raw / best_ours}
    record["repeats"] = args.repeats
    harness.emit("weight_sync", record, args.save)
