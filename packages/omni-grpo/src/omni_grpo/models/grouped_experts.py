"""LoRA on the fused MoE experts without materialising ``W + scale * B A``: grouped low-rank GEMMs.

Why our own module: peft (0.21.2, the newest release) adapts the fused expert tensors
(``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) through ``target_parameters``, a
parametrisation that rebuilds ``W_e + scale * B_e A_e`` for all 128 experts of a layer at every
forward — decode steps included, where a step needs a few rows per expert. On one H200 at the
released depth that made LoRA generation 3.7x slower than attention-only LoRA (issue 27). Here the
experts compute ``x W_e + scale * (x A_e^T) B_e^T`` per routed (token, expert) pair with grouped
GEMMs over the tokens sorted by expert: the base GEMM reads each hit expert's weight once and the
adapter GEMMs are rank-16, in generation, in the training forward and (through autograd) in its
backward.

peft stays the adapter format: this is a subclass of peft's ``ParamWrapper`` swapped onto the
outer wrapper of each experts module (``__class__`` only: same parameters, names, state dict,
``get_delta_weight``, merge and the ``disable_adapters`` toggle), so checkpoints, ``PeftModel``
loading, merged sync and export are untouched. Whenever the adapters are disabled, merged, or
not exactly our one adapter, it defers to peft's own forward.

The low-rank factors follow peft's layout (``get_delta_weight``): ``lora_A.weight`` is
``[E * r, in]`` read as ``(E, r, in)`` and ``lora_B.weight`` is ``[out, r * E]`` read as
``(out, r, E)``, with ``in`` the dimension contracted with ``x`` in either expert layout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

ADAPTER = "default"  # the one peft adapter omni_grpo.models.lora creates
# the attribute a wrapper's cached bf16 factors live in (lora_factors; decode_kernels' too)
FACTOR_CACHE = "_omni_grouped_cache"
_GROUPED_CLASS: type | None = None


def pad_to_16_bytes(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``x [T, K]`` and ``w [G, K, N]`` zero-padded to K and N multiples of 8 (bf16: 16 bytes),
    and the true N. Why: torch's grouped GEMM refuses strides that are not multiples of 16 bytes,
    which a LoRA rank of 4 (or any rank not a multiple of 8) makes; the zero rows and columns add
    nothing to the product."""
    k, n = w.shape[-2], w.shape[-1]
    pad_k, pad_n = -k % 8, -n % 8
    if pad_k or pad_n:
        x = torch.nn.functional.pad(x, (0, pad_k))
        w = torch.nn.functional.pad(w, (0, pad_n, 0, pad_k))
    return x, w, n


# Routed rows (tokens x top_k) up to which generation's grouped products take the Triton kernel
# (``models.grouped_gemm``), a decode step's: on the H200 it ran them near the copy-bandwidth
# limit where torch's took 1.4-2x as long, and the rank-16 adapter products in 4-7 us against
# 18-56; at 16,384 rows (a prefill's size) torch's base products were the faster (380 vs 436 us).
DECODE_ROWS = 4096


def takes_decode_route(hidden: torch.Tensor, dtype: torch.dtype, pairs: int) -> bool:
    """Whether a block's routing and grouped products take the Triton kernels
    (``models.route_plan``, ``models.grouped_gemm``) instead of torch's.

    Only where nothing backpropagates (generation: a decode step, a short prefill) on CUDA in
    bf16, up to ``DECODE_ROWS`` routed pairs: the training forward keeps torch's kernels and
    autograd."""
    return (
        hidden.is_cuda
        and dtype == torch.bfloat16
        and not torch.is_grad_enabled()
        and pairs <= DECODE_ROWS
    )


class ExpertOrder(NamedTuple):
    """A block's (token, slot) pairs in expert order: ``perm``, its inverse ``inv``, each
    expert's cumulative end ``offs``, each sorted pair's token ``tokens`` (``perm // top_k``)
    and, from the one-kernel route (``models.route_plan``), the grouped GEMM's tile map."""

    perm: torch.Tensor
    inv: torch.Tensor
    offs: torch.Tensor
    tokens: torch.Tensor
    tiles: tuple[torch.Tensor, torch.Tensor] | None


def expert_order(
    top_k_index: torch.Tensor, num_experts: int, fused: bool, stable: bool = False
) -> ExpertOrder:
    """:class:`ExpertOrder` of ``top_k_index [T, k]``. ``fused`` (CUDA, up to ``DECODE_ROWS``
    pairs): one Triton kernel, stable, with the tile map; else torch's sort (``stable`` as asked)
    and no tile map. One map serves the block's six grouped products (the same rows and
    offsets), so it is made once a block."""
    if fused and top_k_index.is_cuda and top_k_index.numel() <= DECODE_ROWS:
        from omni_grpo.models.route_plan import route_plan

        perm, inv, offs, tokens, tile_expert, tile_row = route_plan(top_k_index, num_experts)
        return ExpertOrder(perm, inv, offs, tokens, (tile_expert, tile_row))
    perm, inv, offs = sort_by_expert(top_k_index, num_experts, stable)
    return ExpertOrder(perm, inv, offs, perm // top_k_index.shape[-1], None)


def grouped_mm(
    x: torch.Tensor,
    w: torch.Tensor,
    offs: torch.Tensor,
    plan: Any = None,
    gather: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[rows of group g] = x[rows of group g] @ w[g]`` with ``offs`` the groups' cumulative ends.

    ``plan`` (a tile map, :func:`expert_order`): the Triton kernel, which may read ``x``'s rows
    through ``gather`` (the product of ``x[gather]``: ``models.grouped_gemm.gmm``). Else, CUDA
    bf16: torch's grouped GEMM (one launch, no host sync: CUDA-graph capturable). Elsewhere (the
    CPU tests, fp32) a loop over the groups, which reads the offsets back to the host.
    """
    if plan is not None:
        from omni_grpo.models.grouped_gemm import gmm

        return gmm(x.to(w.dtype), w, offs, plan, gather=gather)
    if gather is not None:
        x = x.index_select(0, gather)
    if x.is_cuda and w.dtype == torch.bfloat16:
        fn = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
        x, w, n = pad_to_16_bytes(x.to(w.dtype), w)
        out = fn(x, w, offs=offs)
        return out if out.shape[-1] == n else out[:, :n]
    out = x.new_empty(x.shape[0], w.shape[-1], dtype=torch.promote_types(x.dtype, w.dtype))
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = x[start:end].to(out.dtype) @ w[g].to(out.dtype)
        start = end
    return out


@torch.compiler.disable
def lora_factors(wrapper: Any, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A^T (E, in, r), scale * B^T (E, r, out))`` of one peft ``ParamWrapper`` in ``dtype``.

    Without grad (generation) the casted factors are cached on the wrapper until the adapter
    weights change (their ``_version`` moves at every optimizer step): a decode step then reads
    them as bf16 once instead of casting the fp32 adapters at every layer call; the cache also
    keeps their addresses fixed for a CUDA-graph replay.

    Never compiled (``trainer.compile`` runs eagerly here): inductor may lay a computed operand
    out as it likes, and torch 2.11's grouped GEMM then refused ``scale * B^T`` laid out expert-
    minor; as a graph input it keeps the layout made here. The scale is folded into the rank-r
    ``B^T`` (a small tensor) so the adapter term costs one add over the rows.
    """

    def make(a_w: torch.Tensor, b_w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        experts = wrapper.num_experts
        scale = float(wrapper.scaling[ADAPTER])
        a_t = a_w.reshape(experts, -1, a_w.shape[-1]).transpose(1, 2).to(dtype)  # (E, in, r)
        b_t = b_w.reshape(b_w.shape[0], -1, experts).permute(2, 1, 0).to(dtype)  # (E, r, out)
        # grouped GEMM operands must be row- or column-major per group: B^T's permute is neither
        return a_t, (b_t * scale).contiguous()

    return cached_factors(wrapper, dtype, make, cache=not torch.is_grad_enabled())


def cached_factors(
    layer: Any,
    dtype: torch.dtype,
    make: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    tag: str = "",
    cache: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``make(A, B)`` of ``layer``'s adapter weights, kept on the layer (``FACTOR_CACHE``) until
    the adapters change (their data pointers or ``_version``), the ``dtype`` or the ``tag`` (which
    of this module's users made it) does; ``cache=False``: made afresh, nothing kept."""
    a_w, b_w = layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight
    key = (tag, a_w.data_ptr(), a_w._version, b_w.data_ptr(), b_w._version, dtype)
    cached = layer.__dict__.get(FACTOR_CACHE) if cache else None
    if cached is not None and cached[0] == key:
        return cached[1]
    factors = make(a_w, b_w)
    if cache:
        object.__setattr__(layer, FACTOR_CACHE, (key, factors))
    return factors


def invalidate_factor_caches(model: nn.Module) -> None:
    """Drop every cached bf16 factor pair (:func:`cached_factors`: the experts', the decode
    steps' and exact mode's LoRA linears').

    Why: the cache is keyed on the adapters' ``_version``, but torch's fused AdamW (the CUDA
    optimizer, ``fused=True``) updates parameters in place without bumping it (torch 2.11-2.15),
    so after a step the next rollout would sample with the previous adapters. The torch backend
    calls this after every optimizer step.
    """
    for module in model.modules():
        if FACTOR_CACHE in module.__dict__:
            del module.__dict__[FACTOR_CACHE]


def _lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    transposed: bool,
    offs: torch.Tensor,
    lora: tuple[torch.Tensor, torch.Tensor] | None,
    plan: Any = None,
    gather: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x W_e (+ (x A_e^T) (scale B_e^T))`` for rows grouped by expert (``gather``: of
    ``x[gather]``, read through the index where the Triton kernel runs)."""
    out = grouped_mm(x, weight if transposed else weight.transpose(-2, -1), offs, plan, gather)
    if lora is not None:
        a_t, b_t = lora
        out = out + grouped_mm(grouped_mm(x, a_t, offs, plan, gather), b_t, offs, plan)
    return out


class ExpandSorted(torch.autograd.Function):
    """``hidden[sorted_tokens]`` (each token once per routed expert, in expert order), whose
    backward is a gather plus a sum over the ``top_k`` copies — deterministic, unlike the
    scatter-add autograd gives an index (which was 1.9 s of a 9.5 s update in the profile)."""

    @staticmethod
    def forward(
        ctx: Any, hidden: torch.Tensor, tokens: torch.Tensor, inv: torch.Tensor, top_k: int
    ) -> torch.Tensor:
        ctx.save_for_backward(inv)
        ctx.top_k = top_k
        return hidden.index_select(0, tokens)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (inv,) = ctx.saved_tensors
        pairs = grad.index_select(0, inv)
        return pairs.view(-1, ctx.top_k, grad.shape[-1]).sum(1), None, None, None


class Unsort(torch.autograd.Function):
    """Rows from expert order back to (token, slot) order; backward is the inverse gather."""

    @staticmethod
    def forward(
        ctx: Any, rows: torch.Tensor, inv: torch.Tensor, perm: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(perm)
        return rows.index_select(0, inv)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (perm,) = ctx.saved_tensors
        return grad.index_select(0, perm), None, None


@torch.no_grad()
def sort_by_expert(
    top_k_index: torch.Tensor, num_experts: int, stable: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(perm, inv, offs)``: the (token, slot) pairs in expert order, its inverse, and each
    expert's cumulative end (counted with ``histc``: no host sync). ``stable`` keeps the pairs of
    one expert in token order (the exact path needs the same order in decode and training)."""
    expert_ids, perm = torch.sort(top_k_index.reshape(-1), stable=stable)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    ids = expert_ids.int() if expert_ids.is_cuda else expert_ids.float()  # CPU histc: float only
    counts = torch.histc(ids, bins=num_experts, min=0, max=num_experts - 1)
    return perm, inv, torch.cumsum(counts, dim=0, dtype=torch.int32)


def gated(experts: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
    """``act(gate) * up`` of the fused experts' ``gate_up`` product, as transformers' experts
    module computes it (its own ``_apply_gate`` where it has one)."""
    apply_gate = getattr(experts, "_apply_gate", None)
    if apply_gate is not None:
        return apply_gate(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return experts.act_fn(gate) * up


def grouped_lora_experts_forward(
    experts: nn.Module,
    lora: dict[str, tuple[torch.Tensor, torch.Tensor] | None],
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """The fused experts' forward (transformers' routing contract) with grouped low-rank adapters.

    Tokens are sorted by expert, the offsets counted with ``histc`` (no host sync), every
    projection is one grouped GEMM plus, where adapted, two rank-r grouped GEMMs. The ``top_k``
    outputs of a token are weighted and summed by one batched matmul (fp32 accumulation), which
    replaces the multiply, upcast, sum and downcast passes over the ``tokens x top_k`` rows.
    """
    num_tokens, hidden = hidden_states.shape
    top_k = top_k_index.shape[-1]
    num_experts = experts.gate_up_proj.shape[0]
    dtype = experts.gate_up_proj.dtype
    fused = takes_decode_route(hidden_states, dtype, top_k_index.numel())
    perm, inv, offs, tokens, plan = expert_order(top_k_index, num_experts, fused)
    transposed = bool(getattr(experts, "is_transposed", False))
    if plan is not None:  # the decode route (no grad): the Triton kernel reads each pair's row
        # through its token id (the exact path's gather: the same values, the same numbers)
        x, gather = hidden_states.to(dtype), tokens
    else:
        x, gather = ExpandSorted.apply(hidden_states.to(dtype), tokens, inv, top_k), None
    gate_up = _lora_linear(
        x, experts.gate_up_proj, transposed, offs, lora.get("gate_up_proj"), plan, gather
    )
    out = _lora_linear(
        gated(experts, gate_up).to(dtype),
        experts.down_proj,
        transposed,
        offs,
        lora.get("down_proj"),
        plan,
    )
    pairs = Unsort.apply(out, inv, perm).view(num_tokens, top_k, hidden)
    weights = top_k_weights.to(pairs.dtype).view(num_tokens, 1, top_k)
    return torch.bmm(weights, pairs).view(num_tokens, hidden).to(hidden_states.dtype)


def _grouped_class() -> type:
    """The ``ParamWrapper`` subclass (built on first use: peft is imported lazily)."""
    global _GROUPED_CLASS
    if _GROUPED_CLASS is not None:
        return _GROUPED_CLASS
    from peft.tuners.lora.layer import ParamWrapper

    class GroupedLoraExperts(ParamWrapper):
        """peft's outer ``ParamWrapper`` of a fused experts module, computing grouped low-rank."""

        def _grouped_chain(self) -> tuple[nn.Module, dict[str, Any]] | None:
            """The experts module and its active wrappers by parameter name, or None when peft's
            own forward must run (adapters disabled or merged, another adapter active)."""
            wrappers: dict[str, Any] = {}
            layer: nn.Module = self
            while isinstance(layer, ParamWrapper):
                if (
                    layer.disable_adapters
                    or layer.merged
                    or list(layer.active_adapters) != [ADAPTER]
                    or ADAPTER not in layer.lora_A
                ):
                    return None
                wrappers[layer.parameter_name] = layer
                layer = layer.base_layer
            if not hasattr(layer, "gate_up_proj") or not hasattr(layer, "down_proj"):
                return None
            if set(wrappers) - {"gate_up_proj", "down_proj"}:
                return None
            return layer, wrappers

        def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            chain = self._grouped_chain() if not kwargs.get("adapter_names") else None
            if chain is None or len(args) + len(kwargs) != 2:
                return super().forward(x, *args, **kwargs)
            experts, wrappers = chain
            top_k_index = kwargs.get("top_k_index", args[0] if args else None)
            top_k_weights = kwargs.get("top_k_weights", args[1] if len(args) > 1 else None)
            dtype = experts.gate_up_proj.dtype
            lora = {name: lora_factors(w, dtype) for name, w in wrappers.items()}
            return grouped_lora_experts_forward(experts, lora, x, top_k_index, top_k_weights)

    _GROUPED_CLASS = GroupedLoraExperts
    return GroupedLoraExperts


def use_grouped_lora_experts(model: nn.Module) -> int:
    """Swap the class of every experts module's outer peft wrapper; returns how many were swapped."""
    from peft.tuners.lora.layer import ParamWrapper

    cls = _grouped_class()
    inner_wrappers: set[int] = set()  # wrapped by another ParamWrapper: the outer one computes
    swapped = 0
    for _, module in model.named_modules():  # pre-order: an outer wrapper comes before its inner
        if not isinstance(module, ParamWrapper) or id(module) in inner_wrappers:
            continue
        inner: nn.Module = module.base_layer
        while isinstance(inner, ParamWrapper):
            inner_wrappers.add(id(inner))
            inner = inner.base_layer
        if hasattr(inner, "gate_up_proj") and hasattr(inner, "down_proj"):
            module.__class__ = cls
            swapped += 1
    return swapped
