"""Export the Megatron language model as full HF pseudo-VL tensors, gathered across TP and EP.

Every rank runs the same loop (collectives inside), and every rank gets every full tensor, in the
parameter order of the model. Names go through :data:`.names.NAME_TABLE`; a parameter without a
row raises, and the export checks at the end that every text / lm_head tensor of the HF layout was
produced exactly once (nothing dropped, nothing duplicated). The HF names are omni-extract's
``vl`` column, fused experts in the hub layout ``[E, H, 2I]`` / ``[E, I, H]`` — hand the stream to
``omni_extract.to_server_tensors(..., layout="vl_hub")`` (weight sync does) for server names.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from omni_grpo.backends.megatron._mcore import mcore
from omni_grpo.backends.megatron.config_map import MegatronModelArgs
from omni_grpo.backends.megatron.names import (
    NAME_TABLE,
    UnmappedTensorError,
    fuse_expert_rows,
    hf_names,
    hf_tensors_from_megatron,
    match_megatron,
)


def _all_gather(t: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    size = dist.get_world_size(group)
    if size == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def expected_hf_names(args: MegatronModelArgs) -> set[str]:
    """Every HF text / lm_head tensor name the model must export (per the name table)."""
    out: set[str] = set()
    kinds = {"fc1_expert", "fc2_expert"}  # the same HF tensors as the grouped rows
    for rule in NAME_TABLE:
        if rule.kind in kinds:
            continue
        if rule.megatron == "output_layer.weight" and args.share_embeddings_and_output_weights:
            continue
        layers = range(args.transformer["num_layers"]) if "{L}" in rule.megatron else [None]
        for layer in layers:
            out.update(hf_names(rule, layer))
    return out


def export_hf_weights(lm: nn.Module, args: MegatronModelArgs) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_vl_name, full_tensor)`` for the whole language model (collective: call on all ranks)."""
    ps = mcore().parallel_state
    tp_group = ps.get_tensor_model_parallel_group()
    ep_group = ps.get_expert_model_parallel_group()
    _ep_rank, ep_size = (
        ps.get_expert_model_parallel_rank(),
        ps.get_expert_model_parallel_world_size(),
    )
    cfg = args.transformer
    n_exp = cfg["num_moe_experts"]
    per = n_exp // ep_size
    dims = dict(
        num_heads=cfg["num_attention_heads"],
        num_query_groups=cfg["num_query_groups"],
        head_dim=cfg["kv_channels"],
    )
    pending: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    produced: set[str] = set()

    def emit(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        if name in produced:
            raise UnmappedTensorError(f"export produced {name!r} twice")
        produced.add(name)
        yield name, tensor

    with torch.no_grad():
        for name, param in lm.named_parameters():
            rule, layer, local_e = match_megatron(name)
            t = param.detach()
            if rule.tp_dim is not None:
                t = _all_gather(t, tp_group, rule.tp_dim)
            if rule.kind in ("fc1_grouped", "fc2_grouped"):
                t = _all_gather(t, ep_group, 0)
            if rule.kind in ("fc1_expert", "fc2_expert"):
                assert layer is not None and local_e is not None
                gathered = _all_gather(t.unsqueeze(0), ep_group, 0)
                bucket = pending.setdefault((layer, rule.kind), {})
                for r in range(gathered.shape[0]):
                    bucket[r * per + local_e] = gathered[r]
                if len(bucket) == n_exp:
                    fused = fuse_expert_rows(pending.pop((layer, rule.kind)), rule.kind, n_exp)
                    yield from emit(hf_names(rule, layer)[0], fused)
                continue
            for hf_name, hf_tensor in hf_tensors_from_megatron(name, t, **dims):
                yield from emit(hf_name, hf_tensor)
    if pending:
        raise UnmappedTensorError(
            f"incomplete expert sets at the end of export: {sorted(pending)[:4]}"
        )
    missing = expected_hf_names(args) - produced
    if missing:
        raise UnmappedTensorError(
            f"export is missing {len(missing)} text/lm_head tensors, e.g. {sorted(missing)[:5]}"
        )
