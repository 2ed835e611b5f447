"""LoRA vs full fine-tuning: GRPO step throughput and peak memory, same model and batch, same run.

Each variant runs in its own spawned process, so its peak RSS (CPU) or peak CUDA allocation is its
own: the tiny thinker of ``omni_grpo.testing.rollouts.rollout_world`` (seeded: both variants get
the same weights and the same rollout batch), one warm-up step, then ``--steps`` timed steps.
Prints one JSON object: each variant's samples/s, peak memory, trainable parameters and optimizer
state bytes, and LoRA's ratios to full fine-tuning.

    uv run python benchmarks/lora.py --steps 5 --rank 16
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import tempfile
import time
from pathlib import Path
from typing import Any


def _variant(lora: dict[str, Any] | None, steps: int, device: str) -> dict[str, float]:
    import torch
    from omni_grpo.backends.torch_backend import TorchBackend
    from omni_grpo.config import AlgoConfig, LoraConfig, TrainerConfig
    from omni_grpo.testing.rollouts import rollout_world
    from omni_grpo.types import GRPOBatch

    with tempfile.TemporaryDirectory() as tmp:
        world = rollout_world(Path(tmp), n_prompts=4, n=8, max_new_tokens=8, seed=0)
    model = world["base"]
    model.set_frozen(visual=False)  # full fine-tuning trains what LoRA may adapt
    torch.manual_seed(0)
    cfg = TrainerConfig(
        device=device,
        lr=1e-3,
        micro_batch_size=8,
        lora=LoraConfig(**lora) if lora is not None else None,
    )
    backend = TorchBackend(model, cfg, AlgoConfig(), pad_token_id=world["eos"])
    groups = world["groups"]
    adv = torch.tensor([[1.0, -1.0] * 4] * len(groups))
    batch = GRPOBatch(groups, adv)
    backend.step(batch)  # warm-up (allocator, optimizer state)
    cuda = backend.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        backend.step(batch)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    opt_bytes = sum(
        t.numel() * t.element_size()
        for s in backend.optimizer.state.values()
        for t in s.values()
        if torch.is_tensor(t)
    )
    samples = sum(len(g) for g in groups) * steps
    return {
        "samples_per_s": samples / seconds,
        "peak_memory_mb": (
            torch.cuda.max_memory_allocated() / 2**20
            if cuda
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        ),
        "trainable_params": float(sum(p.numel() for p in backend.params)),
        "optimizer_state_mb": opt_bytes / 2**20,
    }


def _child(args: tuple[dict[str, Any] | None, int, str], out: Any) -> None:
    out.put(_variant(*args))


def _run(lora: dict[str, Any] | None, steps: int, device: str) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=((lora, steps, device), q))
    p.start()
    result = q.get()
    p.join()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    args = ap.parse_args()
    lora = {
        "rank": args.rank,
        "alpha": 2 * args.rank,
        "targets": ["attention", "experts", "visual", "lm_head"],
    }
    full = _run(None, args.steps, args.device)
    adapted = _run(lora, args.steps, args.device)
    print(
        json.dumps(
            {
                "benchmark": "lora_vs_full",
                "device": args.device,
                "steps": args.steps,
                "lora": lora,
                "full": full,
                "lora_run": adapted,
                "samples_per_s_ratio": adapted["samples_per_s"] / full["samples_per_s"],
                "peak_memory_ratio": adapted["peak_memory_mb"] / full["peak_memory_mb"],
                "trainable_params_ratio": adapted["trainable_params"] / full["trainable_params"],
            }
        )
    )


if __name__ == "__main__":
    main()
