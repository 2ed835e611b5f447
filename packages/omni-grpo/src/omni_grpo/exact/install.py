"""Switch a thinker to exact mode: the forwards that the rollout and the trainer share.

``enable_exact_logprobs(thinker)`` rebinds, on this module tree only, the ``forward`` of every
linear layer (peft's LoRA ``base_layer``/``lora_A``/``lora_B`` included) and RMSNorm of the text
model and the LM head to the row-invariant kernels, every MoE block to ``exact.moe``, the text
attention to ``exact.attention`` (through transformers' attention registry, also during decode
steps: ``models.decode_attention`` leaves it alone), and the media towers to one item per call.
Since the embedded engine samples from this very module, the prefill, every decode step and the
trainer's forwards then compute each token's logits with the same arithmetic; the sampler and
the trainer take the log-softmax with the same kernel (``exact.rowwise.token_logprobs``, handed
to the sampler on the thinker: ``models.decode_step.SAMPLER_LOGPROBS``). peft's LoRA linears keep
their arithmetic; in a decode step they skip its casts (``_lora_linear_forward``).
The rebinding is by ``MethodType`` on the instances (a deep copy rebinds to the copy).
"""

from __future__ import annotations

from types import MethodType
from typing import Any

import torch
from torch import nn

FLAG = "exact_logprobs"


class ExactLogprobsUnsupported(ValueError):
    """``rollout.exact_logprobs`` cannot hold for this model or device."""


def is_exact(model: nn.Module) -> bool:
    """Whether :func:`enable_exact_logprobs` switched ``model`` to exact mode."""
    return bool(getattr(model, FLAG, False))


def check_supported(model: nn.Module) -> None:
    """One-line refusals: exact mode needs CUDA, bf16 weights and Triton."""
    weight = model.lm_head.weight
    if weight.device.type != "cuda":
        raise ExactLogprobsUnsupported(
            f"rollout.exact_logprobs needs the model on a CUDA device (it is on {weight.device}): "
            "its kernels are Triton GPU kernels; turn the option off on CPU"
        )
    if weight.dtype != torch.bfloat16:
        raise ExactLogprobsUnsupported(
            f"rollout.exact_logprobs needs model.dtype bfloat16 (the model is {weight.dtype})"
        )
    try:
        import triton  # noqa: F401
    except ImportError as err:
        raise ExactLogprobsUnsupported(
            "rollout.exact_logprobs needs Triton (pip install triton)"
        ) from err


def _linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    from omni_grpo.exact import precision
    from omni_grpo.exact.matmul import linear

    return linear(x, self.weight, self.bias, precision.COMPUTE_DTYPE)


def _rmsnorm_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    from omni_grpo.exact.rowwise import rmsnorm

    return rmsnorm(x, self.weight, self.variance_epsilon)


def _lora_linear_forward(
    self: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any
) -> torch.Tensor:
    """peft's LoRA linear, ``base(x) + lora_B(lora_A(x)) * scale``, in a decode step without its
    casts: peft casts ``x`` to the fp32 adapters' dtype and the exact linears cast it and both
    adapter weights back to bf16 at every call (four kernels of a few microseconds, four such
    layers a decoder layer). Here the adapters' bf16 copies are cached until they change, and
    ``x`` goes in as it is: ``bf16(fp32(x)) == x`` and a cached cast equals a fresh one, so the
    products, the scale and the add are the trainer's, bit for bit. Grad enabled (the trainer's
    forward), anything but one plain adapter: peft's own forward."""
    from omni_grpo.exact import precision
    from omni_grpo.exact.matmul import linear
    from omni_grpo.models.decode_kernels import plain_adapter
    from omni_grpo.models.grouped_experts import ADAPTER

    if torch.is_grad_enabled() or args or kwargs or not plain_adapter(self):
        return type(self).forward(self, x, *args, **kwargs)
    dtype = precision.COMPUTE_DTYPE
    a_w, b_w = _adapter_copies(self, dtype)
    out = self.base_layer(x)
    low = linear(linear(x, a_w, None, dtype), b_w, None, dtype)
    return out + low * self.scaling[ADAPTER]


def _adapter_copies(layer: Any, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A, B)`` of ``layer``'s adapter in ``dtype``, cached until they change."""
    from omni_grpo.models.grouped_experts import cached_factors

    def make(a_w: torch.Tensor, b_w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return a_w.detach().to(dtype), b_w.detach().to(dtype)

    return cached_factors(layer, dtype, make, tag="exact")


def _is_moe_block(module: nn.Module) -> bool:
    return hasattr(module, "gate") and hasattr(module, "experts")


def enable_exact_logprobs(model: nn.Module) -> dict[str, int]:
    """Switch ``model`` (an ``OmniThinker``) to exact mode; returns how many modules of each kind
    were rebound. Idempotent."""
    from omni_grpo.exact import attention
    from omni_grpo.exact.moe import moe_block_forward
    from omni_grpo.exact.rowwise import token_logprobs
    from omni_grpo.exact.towers import encode_towers_per_item
    from omni_grpo.models.decode_kernels import is_lora_linear, is_rmsnorm
    from omni_grpo.models.decode_step import SAMPLER_LOGPROBS

    check_supported(model)
    if is_exact(model):
        return {}
    counts = {"linear": 0, "rmsnorm": 0, "moe": 0, "lora_linear": 0}
    text = model.model.language_model
    moe_blocks = [m for m in text.modules() if _is_moe_block(m)]
    inside_moe = {id(m) for block in moe_blocks for m in block.modules()}
    for root in (text, model.lm_head):
        for module in root.modules():
            if id(module) in inside_moe:
                continue
            if isinstance(module, nn.Linear):
                module.forward = MethodType(_linear_forward, module)
                counts["linear"] += 1
            elif is_rmsnorm(module):
                module.forward = MethodType(_rmsnorm_forward, module)
                counts["rmsnorm"] += 1
            elif is_lora_linear(module):
                module.forward = MethodType(_lora_linear_forward, module)
                counts["lora_linear"] += 1
    for block in moe_blocks:
        block.forward = MethodType(moe_block_forward, block)
        counts["moe"] += 1
    attention.register()
    for module in text.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            config._attn_implementation = attention.NAME
    text.config._attn_implementation = attention.NAME
    encode_towers_per_item(model)
    setattr(model, SAMPLER_LOGPROBS, token_logprobs)  # the decoders' sampler takes it from here
    setattr(model, FLAG, True)
    return counts
