"""Megatron thinker step throughput (tokens/s, MFU) on one GPU, and weight-sync bandwidth.

A truncated-depth thinker at the real widths (hidden 2048, 32 heads / 4 KV groups, head dim 128,
128 experts top-8, expert FFN 768, vocab 152064), random weights, bf16, built exactly as the
backend builds it (local spec + our grouped experts / SDPA attention / interleaved M-RoPE).

Measured in the same run:
* forward+backward (+ vocab-parallel logprob loss) time with ``torch._grouped_mm`` experts, and the
  same model with megatron-core's ``SequentialMLP`` (the TE-less baseline the reference measured);
* MFU = model FLOPs / time / peak, with model FLOPs = 3 x forward FLOPs (matmuls over the ACTIVE
  parameters: attention projections, router, top-k experts, LM head; plus causal attention
  scores), peak = 989 TFLOP/s (H200/H100 SXM dense bf16 datasheet) and, for reference, the
  measured 8192^3 bf16 matmul rate of this GPU;
* weight sync: export -> server names -> 512 MiB buckets -> one NCCL broadcast per tensor into a
  receiver process on a second GPU, vs one raw NCCL broadcast of the same number of bytes.

Prints ONE JSON object. Usage: ``python benchmarks/megatron_step.py [--layers 4 --batch 4 --seq 2048]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

REAL = {
    "hidden_size": 2048,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "moe_intermediate_size": 768,
    "intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "vocab_size": 152064,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 65536,
    "rope_parameters": {
        "rope_theta": 1e6,
        "mrope_section": [24, 20, 20],
        "mrope_interleaved": True,
    },
}
PEAK_BF16 = 989e12


def forward_flops_per_token(layers: int, seq: int) -> float:
    h, heads, kv, d, inter, topk, vocab, e = 2048, 32, 4, 128, 768, 8, 152064, 128
    attn_proj = h * heads * d + 2 * h * kv * d + heads * d * h
    experts = topk * 3 * h * inter
    router = h * e
    per_layer = 2 * (attn_proj + experts + router) + 2 * 2 * heads * d * seq / 2  # causal QK^T + AV
    return layers * per_layer + 2 * h * vocab


def matmul_rate(device: torch.device) -> float:
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    return 10 * 2 * 8192**3 / (time.perf_counter() - t)


def time_step(th, ids, pos, iters: int, warmup: int, loss: str = "vocab_parallel") -> list[float]:
    from omni_grpo.algo import token_logprobs_from_logits
    from omni_grpo.backends.megatron.vocab_parallel import vocab_parallel_logprobs

    times = []
    for i in range(warmup + iters):
        torch.cuda.synchronize()
        t = time.perf_counter()
        logits = th(ids, pos)
        if loss == "chunked":  # the shared omni_grpo.algo chunked logprobs (checkpointed chunks)
            lp = token_logprobs_from_logits(logits[:, :-1], ids[:, 1:])
        else:  # what the trainer does: megatron's vocab-parallel cross entropy
            lp = vocab_parallel_logprobs(logits[:, :-1], ids[:, 1:])
        (-lp.mean()).backward()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t)
        for p in th.lm.parameters():
            p.grad = None
    return times


def profile_step(th, ids, pos, loss: str) -> dict[str, float]:
    """CUDA time per kernel name over one step (top 15): where the step's time goes."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        time_step(th, ids, pos, 1, warmup=0, loss=loss)
    rows = sorted(prof.key_averages(), key=lambda e: -getattr(e, "device_time_total", 0))
    return {e.key[:90]: round(getattr(e, "device_time_total", 0) / 1e3, 2) for e in rows[:15]}


def bench_step(args, impl: str, device: torch.device) -> dict:
    from omni_grpo.backends.megatron.config_map import megatron_model_args
    from omni_grpo.backends.megatron.model import (
        MegatronThinker,
        build_language_model,
        build_transformer_config,
    )
    from omni_grpo.config import MegatronConfig

    cfg = dict(REAL, num_hidden_layers=args.layers)
    margs = megatron_model_args(cfg, MegatronConfig(precision="bf16"), experts_impl=impl)
    lm = build_language_model(margs, build_transformer_config(margs))
    th = MegatronThinker(margs, lm)
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, 151000, (args.batch, args.seq), generator=g).to(device)
    pos = (
        torch.arange(args.seq, dtype=torch.float32, device=device)[None, None]
        .expand(3, args.batch, -1)
        .contiguous()
    )
    iters = args.iters if impl == "grouped" else max(2, args.iters // 3)
    times = time_step(th, ids, pos, iters, warmup=2, loss=args.loss)
    med = statistics.median(times)
    tokens = args.batch * args.seq
    flops = 3 * forward_flops_per_token(args.layers, args.seq) * tokens
    out = {
        "experts": impl,
        "loss": args.loss,
        "step_s_median": med,
        "step_s_all": times,
        "tokens_per_s": tokens / med,
        "model_tflops": flops / med / 1e12,
        "mfu_vs_989": flops / med / PEAK_BF16,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
        "params": sum(p.numel() for p in lm.parameters()),
    }
    if args.profile and impl == "grouped":
        out["top_kernels_ms"] = profile_step(th, ids, pos, args.loss)
    state = {"lm": lm, "th": th, "args": margs} if impl == "grouped" else None
    if impl != "grouped":
        del lm, th
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return out, state


def bench_sync(state: dict, device: torch.device, bucket_mb: int) -> dict:
    from omni_grpo.backends.megatron.export import export_hf_weights
    from omni_grpo.sync.group import build_group, host_store
    from omni_grpo.testing.megatron.sender import push_to_receiver, raw_broadcast, start_receiver

    store = host_store("127.0.0.1", 2, 600)
    rounds = 4  # warm-up sync, timed sync, warm-up raw, timed raw
    proc = start_receiver(store.port, "cuda:1", None, rounds, "omni_grpo_bench")
    group = build_group(
        store, group_name="omni_grpo_bench", world_size=2, rank=0, backend="nccl", timeout_s=600
    )
    lm, margs = state["lm"], state["args"]
    warm = push_to_receiver(group, store, export_hf_weights(lm, margs), 0, bucket_mb << 20, device)
    timed = push_to_receiver(group, store, export_hf_weights(lm, margs), 1, bucket_mb << 20, device)
    raw_broadcast(group, store, timed["bytes"], device, 2)
    raw = raw_broadcast(group, store, timed["bytes"], device, 3)
    proc.wait(timeout=300)
    return {
        "bytes": timed["bytes"],
        "tensors": timed["tensors"],
        "buckets": timed["buckets"],
        "bucket_mb": bucket_mb,
        "sync_s": timed["seconds"],
        "sync_gbps": timed["bytes"] / timed["seconds"] / 1e9,
        "raw_broadcast_s": raw,
        "raw_gbps": timed["bytes"] / raw / 1e9,
        "sync_vs_raw": raw / timed["seconds"],
        "warmup_sync_s": warm["seconds"],
        "receiver_tensors": timed["receiver"]["tensors"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--bucket-mb", type=int, default=512)
    ap.add_argument("--no-sync", action="store_true")
    ap.add_argument("--loss", choices=["vocab_parallel", "chunked"], default="vocab_parallel")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="add a per-kernel CUDA time table of one grouped step",
    )
    ap.add_argument(
        "--big-batch",
        type=int,
        default=8,
        help="also time the grouped model at this batch (0: skip)",
    )
    args = ap.parse_args()
    os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    from omni_grpo.backends.megatron.model import init_parallel
    from omni_grpo.config import MegatronConfig

    init_parallel(MegatronConfig())
    device = torch.device("cuda", torch.cuda.current_device())
    result = {
        "gpu": torch.cuda.get_device_name(device),
        "config": {
            "layers": args.layers,
            "batch": args.batch,
            "seq": args.seq,
            "hidden": 2048,
            "experts": "128 top-8",
            "expert_ffn": 768,
            "vocab": 152064,
            "dtype": "bf16",
        },
        "matmul_8192_tflops": matmul_rate(device) / 1e12,
    }
    seq, _ = bench_step(args, "sequential", device)
    grouped, state = bench_step(args, "grouped", device)
    result["sequential"] = seq
    result["grouped"] = grouped
    result["grouped_speedup_vs_sequential"] = seq["step_s_median"] / grouped["step_s_median"]
    result["mfu_vs_measured_matmul"] = grouped["model_tflops"] / result["matmul_8192_tflops"]
    if not args.no_sync and torch.cuda.device_count() > 1:
        result["weight_sync"] = bench_sync(state, device, args.bucket_mb)
    del state
    torch.cuda.empty_cache()
    if args.big_batch:
        big = argparse.Namespace(**{**vars(args), "batch": args.big_batch})
        result[f"grouped_batch{args.big_batch}"], _ = bench_step(big, "grouped", device)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
