"""Megatron thinker step throughput (tokens/s, MFU) on one GPU, and weight-sync bandwidth.

A truncated thinker at the released widths, built as the backend builds it: forward + backward +
vocab-parallel logprob loss with grouped experts against megatron-core's ``SequentialMLP``; MFU
over 989 TFLOP/s and over the matmul rate measured here; the weight sync into a receiver on a
second GPU against one raw NCCL broadcast of the same bytes (docs/benchmarks.md, "Methods").

    python benchmarks/megatron_step.py [--layers 4 --batch 4 --seq 2048]
"""

import argparse
import os
import statistics
from typing import Any

import harness
import roofline
import torch
from released import ROPE, TEXT, VOCAB
from torch.profiler import ProfilerActivity, profile

REAL = TEXT | {"norm_topk_prob": True, "vocab_size": VOCAB, "rms_norm_eps": 1e-6}
REAL |= {"max_position_embeddings": 65536, "rope_parameters": ROPE}
PEAK_BF16 = 989e12


def time_step(th: Any, ids: Any, pos: Any, iters: int, warmup: int, loss: str) -> list[float]:
    """Seconds of each forward + logprob loss + backward after ``warmup`` untimed ones."""
    from omni_grpo.algo import token_logprobs_from_logits
    from omni_grpo.backends.megatron.vocab_parallel import vocab_parallel_logprobs

    def step() -> None:
        logits = th(ids, pos)
        if loss == "chunked":  # the shared omni_grpo.algo chunked logprobs (checkpointed chunks)
            lp = token_logprobs_from_logits(logits[:, :-1], ids[:, 1:])
        else:  # what the trainer does: megatron's vocab-parallel cross entropy
            lp = vocab_parallel_logprobs(logits[:, :-1], ids[:, 1:])
        (-lp.mean()).backward()

    times = []
    for i in range(warmup + iters):
        with harness.timed("cuda") as t:
            step()
        times += [t.s] if i >= warmup else []
        for p in th.lm.parameters():
            p.grad = None
    return times


def bench_step(args: argparse.Namespace, impl: str, device: torch.device) -> tuple:
    from omni_grpo.backends.megatron import model as mm
    from omni_grpo.backends.megatron.config_map import megatron_model_args
    from omni_grpo.config import MegatronConfig

    cfg = dict(REAL, num_hidden_layers=args.layers)
    margs = megatron_model_args(cfg, MegatronConfig(precision="bf16"), experts_impl=impl)
    lm = mm.build_language_model(margs, mm.build_transformer_config(margs))
    th = mm.MegatronThinker(margs, lm)
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, 151000, (args.batch, args.seq), generator=g).to(device)
    pos = torch.arange(args.seq, dtype=torch.float32, device=device)[None, None]
    pos = pos.expand(3, args.batch, -1).contiguous()
    iters = args.iters if impl == "grouped" else max(2, args.iters // 3)
    times = time_step(th, ids, pos, iters, warmup=2, loss=args.loss)
    med, tokens = statistics.median(times), args.batch * args.seq
    sizes = roofline.text_sizes({"text_config": cfg}, 0, [])  # causal attention, all logits
    flops = 3 * roofline.forward_flops(sizes, [args.seq] * args.batch, tokens)
    out = {"experts": impl, "loss": args.loss, "step_s_median": med, "step_s_all": times}
    out |= {"tokens_per_s": tokens / med, "model_tflops": flops / med / 1e12}
    out |= {"mfu_vs_989": flops / med / PEAK_BF16}
    out["peak_mem_gib"] = harness.peak_bytes(device) / harness.GIB
    out["params"] = sum(p.numel() for p in lm.parameters())
    if args.profile and impl == "grouped":  # CUDA time per kernel name over one step (top 15)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            time_step(th, ids, pos, 1, warmup=0, loss=args.loss)
        rows = sorted(prof.key_averages(), key=lambda e: -getattr(e, "device_time_total", 0))
        ms = {e.key[:90]: round(getattr(e, "device_time_total", 0) / 1e3, 2) for e in rows[:15]}
        out["top_kernels_ms"] = ms
    state = {"lm": lm, "th": th, "args": margs} if impl == "grouped" else None
    del lm, th
    torch.cuda.empty_cache()
    harness.peak_bytes(device, reset=True)
    return out, state


def bench_sync(state: Any, device: torch.device, bucket_mb: int) -> dict[str, Any]:
    from omni_grpo.backends.megatron.export import export_hf_weights
    from omni_grpo.sync.group import build_group, host_store
    from omni_grpo.testing.megatron.sender import push_to_receiver, raw_broadcast, start_receiver

    store = host_store("127.0.0.1", 2, 600)
    rounds = 4  # warm-up sync, timed sync, warm-up raw, timed raw
    proc = start_receiver(store.port, "cuda:1", None, rounds, "omni_grpo_bench")
    kw = {"group_name": "omni_grpo_bench", "world_size": 2, "rank": 0, "backend": "nccl"}
    group = build_group(store, **kw, timeout_s=600)
    lm, margs, bucket = state["lm"], state["args"], bucket_mb << 20
    warm = push_to_receiver(group, store, export_hf_weights(lm, margs), 0, bucket, device)
    timed = push_to_receiver(group, store, export_hf_weights(lm, margs), 1, bucket, device)
    raw_broadcast(group, store, timed["bytes"], device, 2)
    raw = raw_broadcast(group, store, timed["bytes"], device, 3)
    proc.wait(timeout=300)
    out = {k: timed[k] for k in ("bytes", "tensors", "buckets")} | {"bucket_mb": bucket_mb}
    sync_s, nbytes = timed["seconds"], timed["bytes"]
    out |= {"sync_s": sync_s, "sync_gbps": nbytes / sync_s / 1e9, "raw_broadcast_s": raw}
    out |= {"raw_gbps": nbytes / raw / 1e9, "sync_vs_raw": raw / sync_s}
    out |= {"warmup_sync_s": warm["seconds"]}
    return out | {"receiver_tensors": timed["receiver"]["tensors"]}


if __name__ == "__main__":
    ap = harness.parser(__doc__, layers=4, batch=4, seq=2048, iters=6, bucket_mb=512)
    # --profile: a CUDA time per kernel of one grouped step; --big-batch 0: no big-batch run
    harness.add_options(ap, no_sync=False, profile=False, big_batch=8)
    args = harness.add_options(ap, loss=("vocab_parallel", "chunked")).parse_args()
    os.environ |= {k: os.environ.get(k, "0") for k in ("NCCL_CUMEM_ENABLE", "NCCL_NVLS_ENABLE")}
    from omni_grpo.backends.megatron.model import init_parallel
    from omni_grpo.config import MegatronConfig

    init_parallel(MegatronConfig())
    device = torch.device("cuda", torch.cuda.current_device())
    limits = harness.device_limits(device)
    config = {k: vars(args)[k] for k in ("layers", "batch", "seq")}
    config |= {"hidden": TEXT["hidden_size"], "expert_ffn": TEXT["moe_intermediate_size"]}
    config |= {"experts": f"{TEXT['num_experts']} top-{TEXT['num_experts_per_tok']}"}
    config |= {"vocab": VOCAB, "dtype": "bf16"}
    result: dict[str, Any] = {"gpu": torch.cuda.get_device_name(device), "config": config}
    result |= {"matmul_8192_tflops": limits["matmul_flops_per_s"] / 1e12, "limits": limits}
    torch.cuda.empty_cache()  # the limits' buffers are no step's
    harness.peak_bytes(device, reset=True)
    seq, _ = bench_step(args, "sequential", device)
    grouped, state = bench_step(args, "grouped", device)
    result["sequential"], result["grouped"] = seq, grouped
    result["grouped_speedup_vs_sequential"] = seq["step_s_median"] / grouped["step_s_median"]
    result["mfu_vs_measured_matmul"] = grouped["model_tflops"] / result["matmul_8192_tflops"]
    if not args.no_sync and torch.cuda.device_count() > 1:
        result["weight_sync"] = bench_sync(state, device, args.bucket_mb)
    del state
    torch.cuda.empty_cache()
    if args.big_batch:
        big = argparse.Namespace(**{**vars(args), "batch": args.big_batch})
        result[f"grouped_batch{args.big_batch}"], _ = bench_step(big, "grouped", device)
    harness.emit("megatron_step", result, args.save)
