"""LoRA vs full fine-tuning: GRPO step throughput and peak memory, same model and batch, same run.

Each variant in its own process (its peaks are its own) on the seeded tiny thinker and rollout
batch of ``omni_grpo.testing.rollouts.rollout_world``, one warm-up step, then ``--steps`` timed:
samples/s, peak memory, trainable parameters, optimizer state, and LoRA's ratios to full.

    uv run python benchmarks/lora.py --steps 5 --rank 16
"""

import json
import tempfile
from pathlib import Path
from typing import Any

import harness


def variant(lora: dict[str, Any] | None, steps: int, device: str) -> dict[str, float]:
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
    adapters = LoraConfig(**lora) if lora is not None else None
    cfg = TrainerConfig(device=device, lr=1e-3, micro_batch_size=8, lora=adapters)
    backend = TorchBackend(model, cfg, AlgoConfig(), pad_token_id=world["eos"])
    groups = world["groups"]
    batch = GRPOBatch(groups, torch.tensor([[1.0, -1.0] * 4] * len(groups)))
    backend.step(batch)  # warm-up (allocator, optimizer state)
    harness.peak_bytes(backend.device, reset=True)
    with harness.timed(backend.device) as t:
        for _ in range(steps):
            backend.step(batch)
    out = {"samples_per_s": sum(len(g) for g in groups) * steps / t.s}
    out["peak_memory_mb"] = harness.peak_bytes(backend.device) / 2**20
    out["trainable_params"] = float(sum(p.numel() for p in backend.params))
    out["optimizer_state_mb"] = harness.nbytes(harness.state_tensors(backend.optimizer)) / 2**20
    return out


if __name__ == "__main__":
    args = harness.parser(__doc__, steps=5, rank=16, device=("cpu", "cuda", "auto")).parse_args()
    if args.side is not None:  # a child: one variant, one JSON line
        harness.reply(variant(json.loads(args.side), args.steps, args.device))
    lora = {"rank": args.rank, "alpha": 2 * args.rank}
    lora["targets"] = ["attention", "experts", "visual", "lm_head"]
    full, adapted = (harness.rerun(json.dumps(v)) for v in (None, lora))
    record = {"benchmark": "lora_vs_full", "device": args.device, "steps": args.steps, "lora": lora}
    record |= {"full": full, "lora_run": adapted}
    for key in ("samples_per_s", "peak_memory_mb", "trainable_params"):
        record[f"{key.removesuffix('_mb')}_ratio"] = adapted[key] / full[key]
    harness.emit("lora", record, args.save)
