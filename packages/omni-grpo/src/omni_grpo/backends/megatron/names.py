"""HF pseudo-VL <-> megatron-core parameter names, as ONE data table, plus the tensor packings.

The HF side is omni-extract's ``vl`` layout (``model.language_model.*``, ``lm_head.weight``, fused
experts stored hub-style ``gate_up_proj [E, H, 2I]`` / ``down_proj [E, I, H]``). The Megatron side
is a ``GPTModel`` built from our local layer spec. Each row says how one Megatron tensor is made
from HF tensors (``kind``), along which dim tensor parallelism splits it (``tp_dim``) and whether
expert parallelism splits it (``ep``). Loading, export and the tests all read this table; nothing
else knows a name.

Packings (why they exist):

* ``linear_qkv`` interleaves per query group: for each KV group g, the ``heads/groups`` query heads
  of g, then k_g, then v_g. TP then splits whole groups along dim 0, so a gathered tensor is the
  full interleaved matrix again.
* Expert ``fc1`` is ``[gate; up]`` (megatron's GLU takes the first half as the gate). Megatron's
  ``SequentialMLP`` holds ``gate_up_proj[e]`` transposed (``[2I, H]``); our grouped module keeps the
  hub layout ``[E, H, 2I]`` / ``[E, I, H]`` as is (no copy on load or export).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

import torch

Kind = Literal["copy", "qkv", "fc1_grouped", "fc2_grouped", "fc1_expert", "fc2_expert"]

HF_LM = "model.language_model."


@dataclass(frozen=True)
class NameRule:
    """One row: a Megatron name pattern, the HF name pattern(s) it comes from, and how."""

    megatron: str  # with {L} (layer) and {E} (local expert index) placeholders
    hf: tuple[str, ...]  # with {L}; experts refer to the fused per-layer tensors
    kind: Kind
    tp_dim: int | None = None  # dim split by tensor parallelism (None: replicated)
    ep: bool = False  # split across expert-parallel ranks


_LAYER = "decoder.layers.{L}."
_HF_LAYER = HF_LM + "layers.{L}."

NAME_TABLE: tuple[NameRule, ...] = (
    NameRule(
        "embedding.word_embeddings.weight", (HF_LM + "embed_tokens.weight",), "copy", tp_dim=0
    ),
    NameRule("output_layer.weight", ("lm_head.weight",), "copy", tp_dim=0),
    NameRule("decoder.final_layernorm.weight", (HF_LM + "norm.weight",), "copy"),
    NameRule(_LAYER + "input_layernorm.weight", (_HF_LAYER + "input_layernorm.weight",), "copy"),
    NameRule(
        _LAYER + "self_attention.linear_qkv.weight",
        (
            _HF_LAYER + "self_attn.q_proj.weight",
            _HF_LAYER + "self_attn.k_proj.weight",
            _HF_LAYER + "self_attn.v_proj.weight",
        ),
        "qkv",
        tp_dim=0,
    ),
    NameRule(
        _LAYER + "self_attention.linear_proj.weight",
        (_HF_LAYER + "self_attn.o_proj.weight",),
        "copy",
        tp_dim=1,
    ),
    NameRule(
        _LAYER + "self_attention.q_layernorm.weight",
        (_HF_LAYER + "self_attn.q_norm.weight",),
        "copy",
    ),
    NameRule(
        _LAYER + "self_attention.k_layernorm.weight",
        (_HF_LAYER + "self_attn.k_norm.weight",),
        "copy",
    ),
    NameRule(
        _LAYER + "pre_mlp_layernorm.weight",
        (_HF_LAYER + "post_attention_layernorm.weight",),
        "copy",
    ),
    NameRule(_LAYER + "mlp.router.weight", (_HF_LAYER + "mlp.gate.weight",), "copy"),
    # grouped experts (our torch._grouped_mm module): all local experts in one tensor
    NameRule(
        _LAYER + "mlp.experts.fc1_weight",
        (_HF_LAYER + "mlp.experts.gate_up_proj",),
        "fc1_grouped",
        ep=True,
    ),
    NameRule(
        _LAYER + "mlp.experts.fc2_weight",
        (_HF_LAYER + "mlp.experts.down_proj",),
        "fc2_grouped",
        ep=True,
    ),
    # megatron-core SequentialMLP: one MLP per local expert
    NameRule(
        _LAYER + "mlp.experts.local_experts.{E}.linear_fc1.weight",
        (_HF_LAYER + "mlp.experts.gate_up_proj",),
        "fc1_expert",
        ep=True,
    ),
    NameRule(
        _LAYER + "mlp.experts.local_experts.{E}.linear_fc2.weight",
        (_HF_LAYER + "mlp.experts.down_proj",),
        "fc2_expert",
        ep=True,
    ),
)


def _compile(pattern: str) -> re.Pattern[str]:
    esc = re.escape(pattern).replace(r"\{L\}", r"(?P<L>\d+)").replace(r"\{E\}", r"(?P<E>\d+)")
    return re.compile("^" + esc + "$")


_COMPILED = tuple((_compile(r.megatron), r) for r in NAME_TABLE)


class UnmappedTensorError(KeyError):
    """A tensor has no row in :data:`NAME_TABLE` (raised instead of silently dropping weights)."""


def match_megatron(name: str) -> tuple[NameRule, int | None, int | None]:
    """The rule for a Megatron parameter name plus its layer and local-expert indices."""
    for rx, rule in _COMPILED:
        m = rx.match(name)
        if m:
            d = m.groupdict()
            return rule, (int(d["L"]) if "L" in d else None), (int(d["E"]) if "E" in d else None)
    raise UnmappedTensorError(
        f"Megatron parameter {name!r} has no row in the HF<->Megatron name table"
    )


def hf_names(rule: NameRule, layer: int | None) -> tuple[str, ...]:
    return tuple(h.replace("{L}", str(layer)) for h in rule.hf)


# ------------------------------------------------------------------------------------ packings
def pack_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_query_groups: int
) -> torch.Tensor:
    """HF q/k/v projections ``[heads*d, H]``, ``[groups*d, H]`` x2 -> Megatron ``linear_qkv``."""
    g = num_query_groups
    hidden = q.shape[-1]
    if k.shape != v.shape or k.shape[0] % g or q.shape[0] % g:
        raise ValueError(
            f"q/k/v shapes {tuple(q.shape)}/{tuple(k.shape)}/{tuple(v.shape)} do not split into {g} groups"
        )
    return torch.cat(
        [q.reshape(g, -1, hidden), k.reshape(g, -1, hidden), v.reshape(g, -1, hidden)], dim=1
    ).reshape(-1, hidden)


def unpack_qkv(
    qkv: torch.Tensor, num_heads: int, num_query_groups: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_qkv` on the full (TP-gathered) tensor."""
    g, per = num_query_groups, num_heads // num_query_groups
    hidden = qkv.shape[-1]
    expected = g * (per + 2) * head_dim
    if qkv.shape[0] != expected:
        raise ValueError(
            f"linear_qkv has {qkv.shape[0]} rows, expected {expected} (groups={g}, heads={num_heads})"
        )
    x = qkv.reshape(g, (per + 2) * head_dim, hidden)
    q, k, v = torch.split(x, [per * head_dim, head_dim, head_dim], dim=1)
    return q.reshape(-1, hidden), k.reshape(-1, hidden), v.reshape(-1, hidden)


def fc1_from_hf(gate_up: torch.Tensor) -> torch.Tensor:
    """HF fused ``gate_up_proj [E, H, 2I]`` -> Megatron ``fc1 [E, 2I, H]`` (gate rows then up rows)."""
    return gate_up.transpose(1, 2).contiguous()


def fc1_to_hf(fc1: torch.Tensor) -> torch.Tensor:
    return fc1.transpose(1, 2).contiguous()


def fc2_from_hf(down: torch.Tensor) -> torch.Tensor:
    """HF fused ``down_proj [E, I, H]`` -> Megatron ``fc2 [E, H, I]``."""
    return down.transpose(1, 2).contiguous()


def fc2_to_hf(fc2: torch.Tensor) -> torch.Tensor:
    return fc2.transpose(1, 2).contiguous()


def split_fc1_gate_up(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron ``fc1 [.., 2I, H]`` -> (gate, up), each ``[.., I, H]`` (per-expert HF/server names)."""
    i = fc1.shape[-2] // 2
    return fc1[..., :i, :], fc1[..., i:, :]


# ------------------------------------------------------------------------------------ loading
@dataclass(frozen=True)
class ShardSpec:
    """Which slice of the full model this rank holds."""

    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1


def _tp_slice(t: torch.Tensor, dim: int | None, shard: ShardSpec) -> torch.Tensor:
    if dim is None or shard.tp_size == 1:
        return t
    if t.shape[dim] % shard.tp_size:
        raise ValueError(
            f"dim {dim} of shape {tuple(t.shape)} is not divisible by tp={shard.tp_size}"
        )
    return t.chunk(shard.tp_size, dim=dim)[shard.tp_rank]


def megatron_tensor_from_hf(
    name: str,
    get: Callable[[str], torch.Tensor],
    *,
    num_heads: int,
    num_query_groups: int,
    num_experts: int,
    shard: ShardSpec = ShardSpec(),
) -> torch.Tensor:
    """This rank's shard of Megatron parameter ``name``, built from HF tensors fetched by ``get``."""
    rule, layer, local_e = match_megatron(name)
    hf = hf_names(rule, layer)
    if rule.kind == "copy":
        return _tp_slice(get(hf[0]), rule.tp_dim, shard)
    if rule.kind == "qkv":
        return _tp_slice(pack_qkv(get(hf[0]), get(hf[1]), get(hf[2]), num_query_groups), 0, shard)
    if num_experts % shard.ep_size:
        raise ValueError(f"num_experts={num_experts} not divisible by ep={shard.ep_size}")
    per = num_experts // shard.ep_size
    lo = shard.ep_rank * per
    fused = get(hf[0])
    if fused.shape[0] != num_experts:
        raise ValueError(
            f"{hf[0]}: expected {num_experts} experts on dim 0, got shape {tuple(fused.shape)}"
        )
    if rule.kind in ("fc1_grouped", "fc2_grouped"):
        return fused[lo : lo + per].contiguous()
    assert local_e is not None
    if rule.kind == "fc1_expert":
        return fused[lo + local_e].transpose(0, 1).contiguous()
    return fused[lo + local_e].transpose(0, 1).contiguous()  # fc2_expert: [I, H] -> [H, I]


def hf_shapes_check(name: str, tensor: torch.Tensor, hidden: int, inter: int) -> None:
    """Guard against the square-shape trap: fused experts must be hub-layout [E,H,2I] / [E,I,H]."""
    if name.endswith("mlp.experts.gate_up_proj") and tuple(tensor.shape[1:]) != (hidden, 2 * inter):
        raise ValueError(
            f"{name}: expected [E, {hidden}, {2 * inter}] (hub VL layout), got {tuple(tensor.shape)}"
        )
    if name.endswith("mlp.experts.down_proj") and tuple(tensor.shape[1:]) != (inter, hidden):
        raise ValueError(
            f"{name}: expected [E, {inter}, {hidden}] (hub VL layout), got {tuple(tensor.shape)}"
        )


# ------------------------------------------------------------------------------------ export
def hf_tensors_from_megatron(
    name: str,
    full: torch.Tensor,
    *,
    num_heads: int,
    num_query_groups: int,
    head_dim: int,
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF (pseudo-VL) tensors from one FULL (TP-gathered, and for grouped experts EP-gathered) tensor.

    Per-expert Megatron tensors (``fc*_expert``) are collected by the caller into the fused HF tensor
    with :func:`fuse_expert_rows`; they are not handled here.
    """
    rule, layer, _ = match_megatron(name)
    hf = hf_names(rule, layer)
    if rule.kind == "copy":
        yield hf[0], full
    elif rule.kind == "qkv":
        yield from zip(hf, unpack_qkv(full, num_heads, num_query_groups, head_dim), strict=False)
    elif rule.kind in ("fc1_grouped", "fc2_grouped"):
        yield hf[0], full  # already the hub layout
    else:
        raise ValueError(f"{name}: per-expert tensors must be fused with fuse_expert_rows")


def fuse_expert_rows(
    per_expert: Mapping[int, torch.Tensor], kind: Kind, num_experts: int
) -> torch.Tensor:
    """Stack per-expert Megatron fc1 ``[2I,H]`` / fc2 ``[H,I]`` (global expert index) into HF fused layout."""
    missing = sorted(set(range(num_experts)) - set(per_expert))
    if missing:
        raise UnmappedTensorError(f"experts {missing[:8]}... missing while fusing {kind}")
    stacked = torch.stack([per_expert[e] for e in range(num_experts)])
    return fc1_to_hf(stacked) if kind == "fc1_expert" else fc2_to_hf(stacked)
