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

With ``rollout.exact_logprobs`` the policy's forward must keep the exact kernels that the
rollout ran (``omni_grpo.exact`` rebinds the layers' modules to them), so it is not compiled.
Everything after it may be: each decoder layer then checkpoints with :class:`ExactFirstForward`
— its forward runs the exact layer without a graph (the logits, so the logprobs, are the
rollout's bit for bit) and its backward recomputes the layer on a *twin* (:func:`twin_layer`: the
same parameters, the modules as they were before exact mode rebound them) whose parts are
compiled, under ``kernel_switch.torch_kernels``, and backpropagates through that recompute. The
gradients are those of torch's compiled forward at the same weights, as in the uncompiled exact
path's recompute (which runs torch's kernels too).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from types import MethodType
from typing import Any

import torch
from torch import nn

from omni_grpo.models.kernel_switch import torch_kernels

PARTS: tuple[str, ...] = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
# Variants per module class: grad / no-grad / checkpoint's no-grad first pass, adapters on / off
# (the LoRA reference), a couple of dynamic-shape specialisations. Past the limit dynamo would
# silently fall back to eager; the default (8) is close to what one run needs.
RECOMPILE_LIMIT = 32


def text_decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The text model's decoder layers (the towers' blocks have other classes)."""
    return [m for m in model.modules() if type(m).__name__.endswith("TextDecoderLayer")]


def twin_layer(module: nn.Module) -> nn.Module:
    """A copy of ``module``'s tree that shares its parameters and buffers (no memory) but not its
    modules' attributes: what is rebound on the original later (exact mode's forwards, its
    attention implementation on the config) is not on the twin. Taken before exact mode."""
    twin = copy.copy(module)
    state = dict(module.__dict__)
    for key, value in state.items():  # methods bound to the original act on the twin
        if isinstance(value, MethodType) and value.__self__ is module:
            state[key] = MethodType(value.__func__, twin)
    state["_parameters"] = dict(module._parameters)
    state["_buffers"] = dict(module._buffers)
    state["_modules"] = {
        k: None if m is None else twin_layer(m) for k, m in module._modules.items()
    }
    config = state.get("config")
    if config is not None and hasattr(config, "_attn_implementation"):
        state["config"] = copy.copy(config)  # exact mode sets its attention on the original's
    if "gradient_checkpointing" in state:
        state["gradient_checkpointing"] = False  # the twin IS the recompute
    twin.__dict__ = state
    return twin


class ExactFirstForward(torch.autograd.Function):
    """A layer's exact forward without a graph; its backward a recompute on the compiled twin.

    As torch's reentrant checkpoint, but the recompute runs another module (the twin, compiled,
    under ``torch_kernels``). ``anchor``: an empty tensor that requires grad, so the backward runs
    even when the layer's input does not need a gradient (LoRA with frozen embeddings: the
    adapters' gradients come from inside the recompute)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        run: Callable[[torch.Tensor], Any],
        twin: Callable[[torch.Tensor], Any],
        hidden: torch.Tensor,
        anchor: torch.Tensor,
    ) -> torch.Tensor:
        ctx.twin, ctx.needs_hidden = twin, hidden.requires_grad
        ctx.save_for_backward(hidden)
        ctx.autocast = (
            torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
        )
        with torch.no_grad():
            out = run(hidden)
        return _hidden_of(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        (hidden,) = ctx.saved_tensors
        h = hidden.detach().requires_grad_(ctx.needs_hidden)
        autocast = torch.autocast("cuda", dtype=ctx.autocast, enabled=ctx.autocast is not None)
        with torch.enable_grad(), torch_kernels(), autocast:
            out = _hidden_of(ctx.twin(h))
        torch.autograd.backward(out, grad)
        return None, None, h.grad if ctx.needs_hidden else None, None


def _hidden_of(out: Any) -> torch.Tensor:
    """A decoder layer's hidden states (transformers returns them alone or first in a tuple)."""
    return out[0] if isinstance(out, tuple) else out


def _exact_first_checkpoint(
    function: partial, hidden: torch.Tensor, *args: Any, twin: nn.Module, anchor: torch.Tensor
) -> torch.Tensor:
    """``_gradient_checkpointing_func`` of a layer in exact mode: transformers hands it the
    layer's forward with its keyword arguments bound (``function.keywords``); the twin is called
    with the same ones."""
    kwargs = dict(function.keywords or {})
    return ExactFirstForward.apply(
        lambda h: function(h, *args), lambda h: twin(h, *args, **kwargs), hidden, anchor
    )


class CompiledLayers:
    """Compiled ``forward`` of each part of each text decoder layer, swapped in on demand; in
    exact mode (:meth:`exact_mode`) the compiled parts are a twin's, used by the recompute."""

    def __init__(self, model: nn.Module) -> None:
        layers = text_decoder_layers(model)
        if not layers:
            raise ValueError(
                f"trainer.compile: {type(model).__name__} has no text decoder layers to compile"
            )
        from torch._dynamo import config as dynamo_config

        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
        self.layers = layers
        # before exact mode can rebind anything: the twins keep the modules as compiled here
        self.twins = nn.ModuleList([twin_layer(layer) for layer in layers])
        self.parts: list[tuple[nn.Module, Any]] = []
        for layer in layers:
            for name in PARTS:
                part = getattr(layer, name, None)
                if part is not None:
                    self.parts.append((part, torch.compile(part.forward, dynamic=True)))
        self.exact = False

    def exact_mode(self, compile_twins: bool = True) -> None:
        """Exact mode is on for the model: its layers' forwards stay exact and uncompiled, each
        layer checkpoints with :class:`ExactFirstForward` over its compiled twin. Idempotent.
        ``compile_twins=False``: eager twins (the CPU test of the mechanism)."""
        if self.exact:
            return
        for twin in self.twins if compile_twins else ():
            for name in PARTS:
                part = getattr(twin, name, None)
                if part is not None:
                    part.forward = torch.compile(part.forward, dynamic=True)
        anchor = torch.empty(0, requires_grad=True)
        for layer, twin in zip(self.layers, self.twins, strict=True):
            if not getattr(layer, "gradient_checkpointing", False):
                raise ValueError(
                    "rollout.exact_logprobs with trainer.compile needs "
                    "trainer.gradient_checkpointing: the compiled recompute is its backward"
                )
            layer._gradient_checkpointing_func = partial(
                _exact_first_checkpoint, twin=twin, anchor=anchor
            )
        self.exact = True

    @contextmanager
    def active(self) -> Iterator[None]:
        """The compiled forwards inside the block (an instance attribute shadows the class's).
        In exact mode nothing is swapped: the layers stay exact, the twins are compiled."""
        if self.exact:
            yield
            return
        for part, compiled in self.parts:
            part.forward = compiled
        try:
            yield
        finally:
            for part, _ in self.parts:
                del part.forward
