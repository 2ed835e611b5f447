"""``trainer.checkpoint_policy: selective``: keep the attention's products, recompute the rest.

Why: whole-layer checkpointing (``layer``) runs every text decoder layer's forward a second time
in the backward. Of that recompute, the attention part (the q/k/v/o projections with their LoRA
factors and the attention core) is about a third of a layer's matmul FLOPs at the released widths
but little memory per token: its matmul and attention outputs are ~22 KiB per token and layer in
bf16. The MoE block is the other two thirds of the FLOPs and most of the activation memory (eight
experts' gate/up products and activations per token). ``selective`` saves the outputs of the
attention's matmul and attention-core ops during the first forward and recomputes only the MoE
block and the elementwise work around them (torch's selective activation checkpointing,
``torch.utils.checkpoint.create_selective_checkpoint_contexts``, inside transformers' per-layer
checkpoint).

Which op belongs to the attention is decided by module scope, not by op type: the experts' own
products are matmuls too (a per-expert ``mm`` on the CPU). Forward hooks on each text layer's
``self_attn`` mark the scope; they run again in the recompute, so both passes agree on what was
saved. ``benchmarks/one_gpu_thinker.py --checkpoint-policy`` measures the two policies.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from omni_grpo.models.compiled_layers import text_decoder_layers

POLICIES: tuple[str, ...] = ("layer", "selective")

# The attention's products worth keeping: the projections (and their LoRA factors) and the core.
SAVED_OP_NAMES: tuple[str, ...] = (
    "mm",
    "addmm",
    "bmm",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
)
SAVED_OPS: frozenset[Any] = frozenset(
    getattr(torch.ops.aten, name).default
    for name in SAVED_OP_NAMES
    if hasattr(torch.ops.aten, name)
)


class AttentionScope:
    """Whether the current thread is inside a text layer's attention (forward or recompute)."""

    def __init__(self) -> None:
        self._local = threading.local()

    @property
    def depth(self) -> int:
        return getattr(self._local, "depth", 0)

    def enter(self, *_: Any) -> None:
        self._local.depth = self.depth + 1

    def leave(self, *_: Any) -> None:
        self._local.depth = self.depth - 1


def _policy(scope: AttentionScope, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    if scope.depth > 0 and op in SAVED_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def selective_context_fn(model: nn.Module) -> Callable[[], tuple[Any, Any]]:
    """The ``context_fn`` for ``torch.utils.checkpoint.checkpoint`` (non-reentrant) that keeps
    the attention's products of ``model``'s text decoder layers; installs the scope hooks."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    layers = text_decoder_layers(model)
    if not layers:
        raise ValueError(
            "trainer.checkpoint_policy selective: "
            f"{type(model).__name__} has no text decoder layers"
        )
    scope = AttentionScope()
    for layer in layers:
        attn = layer.self_attn
        attn.register_forward_pre_hook(scope.enter)
        attn.register_forward_hook(scope.leave)
    return partial(create_selective_checkpoint_contexts, partial(_policy, scope))
