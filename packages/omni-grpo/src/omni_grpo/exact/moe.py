"""The MoE block in exact mode: router, top-k, experts and their weighted sum, row-invariant.

Every step is chosen so that a token's output depends on that token alone, in the same order in
a decode step and in a training micro-batch: the router logits through the invariant matmul, the
fp32 softmax, top-k and renormalisation in one per-token kernel (``exact.router``; ties between
bf16-equal router logits pick the lower expert in both paths, as a stable sort would;
``torch.topk``'s tie order is the kernel's),
the experts through the invariant grouped GEMM (LoRA adapters as ``x W + scale (x A^T) B^T``,
the grouped path's math, never ``W + B A``; the sum in the ``B`` product's epilogue), and the
top-k outputs, read in expert order, summed in slot order in fp32 by one kernel
(``exact.combine``; the trainer's ``bmm`` picks its kernel from the token count).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from omni_grpo.exact import precision
from omni_grpo.exact.combine import unsort_topk_sum
from omni_grpo.exact.grouped import (
    BLOCK_M,
    RowTiling,
    TileMap,
    grouped_linear,
    row_tiling,
    tile_map,
)
from omni_grpo.exact.matmul import linear
from omni_grpo.exact.router import route as route_kernel
from omni_grpo.exact.rowwise import softmax, tree_sum
from omni_grpo.exact.switch import torch_kernels_on
from omni_grpo.models.grouped_experts import (
    ADAPTER,
    ExpandSorted,
    expert_order,
    gated,
    lora_factors,
)

LoraFactors = tuple[torch.Tensor, torch.Tensor]  # (A^T, scale * B^T)


def _dtype() -> torch.dtype:
    return precision.COMPUTE_DTYPE


def experts_and_adapters(experts: nn.Module) -> tuple[nn.Module, dict[str, LoraFactors]]:
    """The fused experts module under any peft wrappers, and the active adapters' factors by
    parameter name (none when adapters are disabled: the KL reference's forward)."""
    lora: dict[str, LoraFactors] = {}
    layer = experts
    while hasattr(layer, "base_layer") and hasattr(layer, "parameter_name"):
        active = (
            not layer.disable_adapters
            and not layer.merged
            and ADAPTER in layer.lora_A
            and ADAPTER in list(layer.active_adapters)
        )
        if active:
            lora[layer.parameter_name] = lora_factors(layer, _dtype())
        layer = layer.base_layer
    return layer, lora


def _project(
    x: torch.Tensor,
    weight: torch.Tensor,
    transposed: bool,
    grouped: tuple[torch.Tensor, TileMap | None, RowTiling],
    lora: Any,
    gather: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x W`` (+ the adapter's ``(x A^T) (scale B^T)``, added in the ``B`` product's epilogue:
    the bits of the two products' sum); ``grouped``: offsets, map, tiling. ``gather``: the
    products of ``x[gather]``, read through the index by the kernel (no autograd: a forward
    that records no graph)."""
    w = weight if transposed else weight.transpose(-2, -1)  # [E, in, out]
    out = grouped_linear(x, w, *grouped, gather=gather)
    if lora is not None:
        a_t, b_t = lora  # B^T carries the LoRA scale (grouped_experts.lora_factors)
        low = grouped_linear(x, a_t, *grouped, gather=gather)
        out = grouped_linear(low, b_t, *grouped, residual=out)
    return out


def experts_forward(
    experts: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """transformers' experts contract (``[T, H]`` tokens, ``[T, k]`` ids and weights) -> ``[T, H]``."""
    base, lora = experts_and_adapters(experts)
    top_k = top_k_index.shape[-1]
    num_experts = base.gate_up_proj.shape[0]
    # the stable order in every forward (a decode step's one-kernel route is stable too), so a
    # recompute (torch's kernels, torch's sort) sees the pairs as the first
    # forward did; one tile map for the block's six grouped products, none for torch's kernels
    torch_path = torch_kernels_on()
    order = expert_order(top_k_index, num_experts, fused=not torch_path, stable=True)
    perm, inv, offs = order.perm, order.inv, order.offs
    # with no graph to record, the gate_up and LoRA A products read each token's row through
    # the pairs' token ids (gmm's gather: the same values) instead of a gathered [pairs, H] copy
    gather = order.tokens if not torch_path and not torch.is_grad_enabled() else None
    if gather is None:
        x = ExpandSorted.apply(hidden.to(_dtype()), order.tokens, inv, top_k)
    else:
        x = hidden.to(_dtype())
    pairs = order.tokens.numel()
    transposed = bool(getattr(base, "is_transposed", False))
    # a decode step's few pairs: 64-row tiles, the one-kernel route's map; a training
    # micro-batch's or a prefill's many: 128-row tiles (the same bits a row: RowTiling)
    tiling = row_tiling(pairs, grouped=True)
    plan = None
    if not torch_path:
        fits = order.tiles is not None and tiling.block_m == BLOCK_M
        plan = order.tiles if fits else tile_map(offs, pairs, tiling.block_m)
    grouped = (offs, plan, tiling)
    gate_up = _project(x, base.gate_up_proj, transposed, grouped, lora.get("gate_up_proj"), gather)
    out = _project(
        gated(base, gate_up).to(_dtype()),
        base.down_proj,
        transposed,
        grouped,
        lora.get("down_proj"),
    )
    return unsort_topk_sum(out, inv, perm, weights, hidden.dtype)


def route(gate: nn.Module, hidden: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(top_k_index, weights)``: transformers' Qwen3 router (softmax, top-k, renormalised, cast
    to the logits' dtype) with the order-fixed pieces above."""
    logits = linear(hidden, gate.weight, None, _dtype())
    normalize = getattr(gate, "norm_topk_prob", True)
    if logits.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        index, values = route_kernel(logits, top_k, normalize)  # one kernel (exact.router)
        return index, values.to(logits.dtype)
    # CPU without Triton (tests of the plumbing): the same steps in torch, each order-fixed
    probs = softmax(logits)
    values, index = torch.sort(probs, dim=-1, descending=True, stable=True)
    values, index = values[:, :top_k], index[:, :top_k]
    if normalize:
        values = values / tree_sum(values)
    return index, values.to(logits.dtype)


def moe_block_forward(block: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """Replacement ``forward`` of a Qwen3-VL-MoE sparse block (bound with ``MethodType``)."""
    batch, length, width = hidden_states.shape
    flat = hidden_states.reshape(-1, width)
    top_k = getattr(block.gate, "top_k", None) or block.top_k
    index, weights = route(block.gate, flat, top_k)
    return experts_forward(block.experts, flat, index, weights).view(batch, length, width)
