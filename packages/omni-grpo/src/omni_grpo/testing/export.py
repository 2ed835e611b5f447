"""Test rigs for export: a run directory with a "trained" checkpoint, without running GRPO.

``make_trained_run`` prepares a run the way ``train`` does (stored config, extracted ``vl`` and
``audio`` dirs), loads the torch backend's thinker, moves every trainable weight by seeded noise
(so a name or layout mix-up changes the logits) and saves it with the run's own
``save_checkpoint``. ``megatron_state`` turns such a torch-backend state into the Megatron
backend's checkpoint names, built from the HF<->Megatron mapping table itself (megatron-core
cannot run here: it needs Python 3.12), in either expert layout (grouped or ``SequentialMLP``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from omni_grpo.backends.megatron.names import NAME_TABLE, megatron_tensor_from_hf


@dataclass
class TrainedRun:
    run_dir: Path
    omni: Path
    vl_dir: Path
    audio_dir: Path
    weights: dict[str, torch.Tensor]  # the torch backend's trainable state (in-memory layout)
    checkpoint: Path


def run_config(run_dir: Path, omni: Path, overrides: list[str] = ()) -> Any:
    from omni_grpo.config import load_config

    return load_config(
        None,
        [
            f"run.dir={run_dir}",
            f"model.omni_checkpoint={omni}",
            "model.dtype=float32",
            *overrides,
        ],
    )


def make_trained_run(
    run_dir: Path,
    omni: Path,
    *,
    step: int = 3,
    seed: int = 0,
    scale: float = 0.02,
    overrides: list[str] = (),
) -> TrainedRun:
    """A run dir whose checkpoint ``step`` holds perturbed trainable weights (``scale=0``: untouched)."""
    from omni_grpo.models import load_thinker
    from omni_grpo.run.checkpoint import TrainState, save_checkpoint
    from omni_grpo.run.stored_config import store_run_config
    from omni_grpo.trainer import prepare_model

    cfg = run_config(run_dir, omni, list(overrides))
    run_dir.mkdir(parents=True, exist_ok=True)
    store_run_config(cfg, run_dir)
    vl_dir, audio_dir = prepare_model(cfg.model, run_dir)
    thinker = load_thinker(
        vl_dir,
        audio_dir=audio_dir,
        dtype="float32",
        freeze_visual=cfg.model.freeze_visual,
        freeze_lm_head=cfg.model.freeze_lm_head,
    )
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    with torch.no_grad():
        for name, p in thinker.named_parameters():
            if not p.requires_grad:
                continue
            if scale:
                p.add_(torch.randn(p.shape, generator=gen) * scale)
            weights[name] = p.detach().clone()
    ckpt = save_checkpoint(run_dir, TrainState(step=step), weights, {"optimizer": {}})
    return TrainedRun(run_dir, omni, vl_dir, audio_dir, weights, ckpt)


def trained_thinker(run: TrainedRun) -> Any:
    """The run's model with its checkpoint loaded (what the trainer would evaluate)."""
    from omni_grpo.models import load_thinker

    thinker = load_thinker(run.vl_dir, audio_dir=run.audio_dir, dtype="float32")
    params = dict(thinker.named_parameters())
    with torch.no_grad():
        for name, value in run.weights.items():
            params[name].copy_(value)
    return thinker.eval()


def megatron_state(
    weights: dict[str, torch.Tensor], text_config: dict[str, Any], *, grouped: bool = True
) -> dict[str, torch.Tensor]:
    """The Megatron backend's checkpoint (tp = ep = 1) for a torch-backend language-model state.

    Every Megatron name comes from the rows of ``NAME_TABLE`` (``{L}`` over the layers, ``{E}``
    over the experts), every tensor from ``megatron_tensor_from_hf``: the table is the only
    source of truth, so export is checked against the mapping Megatron loads with.
    """
    layers = int(text_config["num_hidden_layers"])
    experts = int(text_config["num_experts"])

    def hf(name: str) -> torch.Tensor:  # HF pseudo-VL, fused experts in the hub layout
        t = weights[name]
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            return t.transpose(1, 2).contiguous()  # [E, 2I, H] / [E, H, I] -> hub layout
        return t

    out: dict[str, torch.Tensor] = {}
    for rule in NAME_TABLE:
        if "{E}" in rule.megatron and grouped or rule.kind.endswith("_grouped") and not grouped:
            continue
        if rule.megatron == "output_layer.weight" and "lm_head.weight" not in weights:
            continue
        for layer in range(layers) if "{L}" in rule.megatron else [None]:
            for e in range(experts) if "{E}" in rule.megatron else [None]:
                name = rule.megatron.replace("{L}", str(layer)).replace("{E}", str(e))
                out[name] = megatron_tensor_from_hf(
                    name,
                    hf,
                    num_heads=int(text_config["num_attention_heads"]),
                    num_query_groups=int(text_config["num_key_value_heads"]),
                    num_experts=experts,
                ).contiguous()
    return out
