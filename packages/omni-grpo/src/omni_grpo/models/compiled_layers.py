"""``trainer.compile``: the text decoder layers' parts compiled for the trainer's passes only.

Why: at the released depth the LoRA update is bound by the elementwise work around the GEMMs,
not by the GEMMs (profile of one 48-layer update on an H200: ``mul``, ``copy_`` and dtype casts
took ~45 % of the CUDA time, in ~100k small kernels): each RMSNorm upcasts, squares, averages,
scales and downcasts in separate passes, the rotary embedding concatenates and multiplies, the
MoE block sorts, gathers and weights its rows. ``torch.compile`` fuses those passes around the
GEMMs without changing what is computed.

What is compiled: the attention, the MoE block and the two norms of every text decoder layer —
each module's ``forward`` (one dynamo cache per module class, shared by all 48 layers: the
parameters are graph inputs), with dynamic shapes, since every micro-batch has its own rows and
length. The layer itself is not compiled, so gradient checkpointing (transformers wraps the layer's
forward) stays outside the compiled regions and recomputes through them.

When: only inside :meth:`CompiledLayers.active` — the torch backend's step, forwards, backward
and recompute included. Generation shares these modules (the embedded engine) and keeps its own
static-KV CUDA-graph decode, which a compiled region's guards and recompiles would break.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

PARTS: tuple[str, ...] = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
# Variants per module class: grad / no-grad / checkpoint's no-grad first pass, adapters on / off
# (the LoRA reference), a couple of dynamic-shape specialisations. Past the limit dynamo would
# silently fall back to eager; the default (8) is close to what one run needs.
RECOMPILE_LIMIT = 32


def text_decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The text model's decoder layers (the towers' blocks have other classes)."""
    return [m for m in model.modules() if type(m).__name__.endswith("TextDecoderLayer")]


class CompiledLayers:
    """Compiled ``forward`` of each part of each text decoder layer, swapped in on demand."""

    def __init__(self, model: nn.Module) -> None:
        layers = text_decoder_layers(model)
        if not layers:
            raise ValueError(
                f"trainer.compile: {type(model).__name__} has no text decoder layers to compile"
            )
        from torch._dynamo import config as dynamo_config

        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
        self.parts: list[tuple[nn.Module, Any]] = []
        for layer in layers:
            for name in PARTS:
                part = getattr(layer, name, None)
                if part is not None:
                    self.parts.append((part, torch.compile(part.forward, dynamic=True)))

    @contextmanager
    def active(self) -> Iterator[None]:
        """The compiled forwards inside the block (an instance attribute shadows the class's)."""
        for part, compiled in self.parts:
            part.forward = compiled
        try:
            yield
        finally:
            for part, _ in self.parts:
                del part.forward
