"""LoRA adapters on the thinker through peft: injection, merged weights for sync/export, peft's format.

Why peft and not our own layers: peft is the kept library (what TRL users already load), and
since 0.17 it adapts raw ``nn.Parameter``s (``target_parameters``), which is what the fused MoE
experts of Qwen3-VL-MoE are (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``): one rank-r
``A``/``B`` pair per expert. peft applies them as a parametrisation ``W + scale * B_e A_e``
rebuilt at every forward; ``trainer.lora.expert_path: grouped`` (the default) keeps peft's
modules and format but computes ``x W_e + scale * (x A_e^T) B_e^T`` with grouped GEMMs
(``omni_grpo.models.grouped_experts``).

The adapters are injected into the VL wrapper (``thinker.vl``, a transformers model, which
peft's parameter targeting needs) in place: the thinker's children are the VL model's own, so the
thinker sees the same LoRA modules; ``lm_head`` is re-pointed because the wrapper replaces its
attribute. Parameter names become peft's (``...q_proj.base_layer.weight``,
``...q_proj.lora_A.default.weight``); only the adapters have ``requires_grad``, so the trainer's
``trainable_state`` and optimizer hold the adapters alone.

A server (or an export) holds plain weights, never adapters: :func:`merged_weights` gives
``W + scale * B A`` under the base names, computed by peft's own ``get_delta_weight`` (the very
delta the forward applies), for the adapted tensors only.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from peft import LoraConfig as PeftLoraConfig

    from omni_grpo.config import LoraConfig

ADAPTER = "default"  # peft's adapter name; the only one we create

# What each ``trainer.lora.targets`` group adapts, as names relative to the VL model (which are the
# thinker's names). "modules": a regex peft full-matches against module names (linear layers);
# "parameters": raw parameters adapted through peft's ``target_parameters``.
LORA_TARGETS: dict[str, dict[str, Any]] = {
    "attention": {"modules": r"model\.language_model\.layers\.\d+\.self_attn\.[qkvo]_proj"},
    # Qwen3-Omni's text layers are all MoE (no dense MLP, no shared expert): the experts are the
    # FFN weights; the router (``mlp.gate``) stays frozen, as in the LoRA-for-RL literature.
    "experts": {"parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]},
    # the vision blocks' and mergers' linear layers; the patch embedding (Conv3d) and the learned
    # position table stay frozen
    "visual": {
        "modules": r"model\.visual\.(?:blocks\.\d+\.(?:attn\.(?:qkv|proj)|mlp\.linear_fc[12])"
        r"|(?:merger|deepstack_merger_list\.\d+)\.linear_fc[12])"
    },
    "lm_head": {"modules": r"lm_head"},
}


def peft_config(cfg: LoraConfig, base: str | None = None) -> PeftLoraConfig:
    """peft's ``LoraConfig`` for our ``trainer.lora`` (also written as ``adapter_config.json``)."""
    from peft import LoraConfig as PeftLoraConfig

    modules = [LORA_TARGETS[t]["modules"] for t in cfg.targets if "modules" in LORA_TARGETS[t]]
    params = [p for t in cfg.targets for p in LORA_TARGETS[t].get("parameters", [])]
    return PeftLoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        # peft: a string is one regex full-matched against module names; [] adapts no module
        target_modules="(?:" + "|".join(modules) + ")" if modules else [],
        target_parameters=params or None,
        base_model_name_or_path=base,
        bias="none",
    )


def apply_lora(model: nn.Module, cfg: LoraConfig) -> None:
    """Inject ``cfg``'s adapters into ``model`` in place; only they remain trainable (fp32).

    ``B`` starts at zero (peft's default), so the adapted model computes the base model's logits.
    """
    from peft import inject_adapter_in_model
    from peft.tuners.tuners_utils import cast_adapter_dtype

    vl = getattr(model, "vl", model)  # OmniThinker: inject into the transformers model it wraps
    inject_adapter_in_model(peft_config(cfg), vl, adapter_name=ADAPTER)
    # fp32 adapters on a bf16 base, as PeftModel does (autocast_adapter_dtype): AdamW steps of
    # lr 1e-5 on bf16 weights would mostly round away; inject_adapter_in_model leaves them bf16.
    cast_adapter_dtype(vl, adapter_name=ADAPTER, autocast_adapter_dtype=True)
    if cfg.expert_path == "grouped":  # peft's expert parametrisation, computed without W + BA
        from omni_grpo.models.grouped_experts import use_grouped_lora_experts

        use_grouped_lora_experts(vl)
    if vl is not model and getattr(model, "lm_head", None) is not vl.lm_head:
        model.lm_head = vl.lm_head  # the wrapper replaced its attribute; the thinker follows
    for name, p in model.named_parameters():  # peft leaves the rest frozen; make sure
        p.requires_grad_(".lora_" in name)


def lora_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(module name, peft LoRA layer)`` of every adapted tensor of ``model``."""
    from peft.tuners.lora.layer import LoraLayer

    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLayer)]


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The base model inside the block: every LoRA layer of ``model`` skips its adapter (peft's
    ``disable_adapter()``, which only ``PeftModel`` has; we inject into the transformers model).
    Exact: the base weights are frozen, so this is the model the adapters started from (``B``
    starts at zero). peft's toggle also clears and restores the adapters' ``requires_grad``."""
    layers = [m for _, m in lora_layers(model)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def _base_name(module_name: str, layer: nn.Module) -> str:
    """The name the adapted tensor has in the unadapted model (and in a VL checkpoint)."""
    plain = module_name.replace(".base_layer", "")
    return f"{plain}.{getattr(layer, 'parameter_name', None) or 'weight'}"


@torch.no_grad()
def merged_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """``W + scale * B A`` of every adapted tensor, under its base name (``hf_memory`` layout).

    Only what LoRA touches: the rest of the model is the base the server already holds. Fresh
    tensors (the live parameters are not modified, unlike peft's ``merge``).
    """
    from peft.tuners.lora.layer import ParamWrapper

    out: dict[str, torch.Tensor] = {}
    for name, layer in lora_layers(model):
        if isinstance(layer, ParamWrapper):
            base = layer.get_param()
        else:
            base = layer.get_base_layer().weight
        delta = layer.get_delta_weight(ADAPTER)
        out[_base_name(name, layer)] = base.detach() + delta.to(base.dtype)
    return out


def is_adapter_name(name: str) -> bool:
    """A parameter name of a LoRA adapter (as ``trainable_state`` of a LoRA run holds them)."""
    return ".lora_A." in name or ".lora_B." in name


def peft_state_dict(adapters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our adapter names -> peft's saved names (``base_model.model.<module>.lora_A.weight``)."""
    return {
        "base_model.model." + n.replace(f".{ADAPTER}.", "."): t.contiguous()
        for n, t in adapters.items()
    }


def save_peft_adapter(
    directory: Path, adapters: dict[str, torch.Tensor], cfg: LoraConfig, base: str | None
) -> None:
    """``adapter_config.json`` + ``adapter_model.safetensors`` as ``PeftModel.save_pretrained``
    writes them, so ``PeftModel.from_pretrained(Qwen3VLMoeForConditionalGeneration, dir)`` on the
    run's extracted ``vl`` directory loads the trained adapter."""
    from safetensors.torch import save_file

    config = peft_config(cfg, base).to_dict()
    config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2, default=str))
    save_file(
        peft_state_dict(adapters),
        str(directory / "adapter_model.safetensors"),
        metadata={"format": "pt"},
    )
