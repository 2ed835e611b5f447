"""Grouped-query attention for one-token decode steps, reading each KV head once.

Why: transformers' SDPA path can only use torch's GQA support without a mask, and a decode step
over a left-padded static KV buffer needs one; the versions we run (5.17 on the GPU image) then
``repeat_kv`` the keys and values to all 32 query heads — 8x the KV-cache bytes written and read
per layer and step, on top of the cache itself. Here the 8 query heads of a KV group become 8
query rows of one SDPA call over that group's keys (the same packing newer transformers
releases do), so the cache is read once, with fp32 accumulation inside the fused kernel. On CUDA, given each
row's first real key and the step's slot (``START_KW``/``SLOT_KW``, passed by the decoder), the
split-KV Triton kernel of ``models.decode_kernel`` reads only the keys a row has (SDPA there ran
at 11-32 % of the copy bandwidth over the whole static buffer).

Used only inside ``models.generation``'s decode steps (``decode_attention`` swaps the text
config's attention implementation for their duration); every other forward — prefill, training,
the reference — keeps the model's own implementation.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

NAME = "omni_gqa_decode"
# Keyword arguments the decoder passes through the layers to the attention function: each row's
# first real key and the step's slot (device tensors), for the split-KV kernel on CUDA.
START_KW, SLOT_KW = "omni_kv_start", "omni_kv_slot"
EXACT = "omni_exact"  # omni_grpo.exact.attention.NAME (not imported: it needs Triton)
_REGISTERED = False


def gqa_decode_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: ``[B, H, q, d]`` query -> ``[B, q, H, d]``."""
    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    if q_len != 1 or heads == kv_heads:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    packed = query.reshape(batch, kv_heads, heads // kv_heads, dim)  # head h -> group h // g
    start, slot = kwargs.get(START_KW), kwargs.get(SLOT_KW)
    if start is not None and slot is not None and query.is_cuda and kernel_enabled():
        from omni_grpo.models.decode_kernel import decode_attention_kernel

        scale = scaling if scaling is not None else dim**-0.5
        out = decode_attention_kernel(packed, key, value, start, slot, scale)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(
            packed, key, value, attn_mask=attention_mask, scale=scaling
        )
    return out.reshape(batch, 1, heads, dim), None


def kernel_enabled() -> bool:
    """``OMNI_GRPO_DECODE_KERNEL=0`` keeps SDPA in the decode steps (a comparison switch)."""
    return os.environ.get("OMNI_GRPO_DECODE_KERNEL", "1") != "0"


def _register() -> None:
    global _REGISTERED
    if not _REGISTERED:
        from transformers import AttentionInterface

        AttentionInterface.register(NAME, gqa_decode_attention)
        _REGISTERED = True


@contextmanager
def decode_attention(layers: nn.ModuleList) -> Iterator[None]:
    """The decoder ``layers`` attend through :func:`gqa_decode_attention` inside the block."""
    _register()
    configs = {id(c): c for c in (layer.self_attn.config for layer in layers)}.values()
    # exact mode (omni_grpo.exact) attends through one kernel in decode and training: kept
    before = [(c, c._attn_implementation) for c in configs if c._attn_implementation != EXACT]
    for config, _ in before:
        config._attn_implementation = NAME
    try:
        yield
    finally:
        for config, name in before:
            config._attn_implementation = name
