"""Megatron-backend checkpoints read as pseudo-VL tensors, through the HF<->Megatron name table.

The Megatron backend checkpoints ``GPTModel`` parameter names (``decoder.layers.N...``); export
needs the pseudo-VL names omni-extract maps back to the hub. :class:`MegatronTrained` is a
:class:`omni_extract.trained.TrainedWeights` view over those files that translates with
:data:`omni_grpo.backends.megatron.names.NAME_TABLE` and its packings (``linear_qkv`` split into
q/k/v; grouped ``fc1``/``fc2`` already in the hub layout; per-expert ``linear_fc1``/``linear_fc2``
of megatron-core's ``SequentialMLP``), one tensor or one expert at a time.

Only full (TP- and EP-gathered) tensors can be mapped: a tensor-parallel slice has the wrong shape
and is refused by the shape check against the base, and a missing local expert is named.
Importing this module never imports megatron-core (the name table is pure torch).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from omni_extract.errors import TensorMismatchError
from omni_extract.names import ExpertPart
from omni_extract.trained import (
    FileRange,
    Piece,
    SafetensorsFiles,
    expert_row_half,
    hub_from_vl_block,
)

from omni_grpo.backends.megatron.names import (
    UnmappedTensorError,
    hf_names,
    match_megatron,
    unpack_qkv,
)


@dataclass
class _VLTensor:
    """How one pseudo-VL tensor is made from the Megatron files."""

    kind: str  # copy | qkv | grouped | expert
    shape: tuple[int, ...]
    dtype: torch.dtype
    source: str | None = None  # Megatron name (copy, qkv, grouped)
    qkv_index: int = 0
    experts: dict[int, str] = field(default_factory=dict)  # expert -> Megatron name (expert)
    fused: str = ""  # gate_up | down


class MegatronTrained:
    """Pseudo-VL view of Megatron parameter files (see the module docstring).

    ``num_heads``, ``num_query_groups``, ``head_dim`` and ``num_experts`` come from the base's
    thinker text config; they decide how ``linear_qkv`` splits and how many experts a layer has.
    """

    def __init__(
        self,
        store: SafetensorsFiles,
        *,
        num_heads: int,
        num_query_groups: int,
        head_dim: int,
        num_experts: int,
    ) -> None:
        self.store = store
        self.dims = dict(num_heads=num_heads, num_query_groups=num_query_groups, head_dim=head_dim)
        self.num_experts = num_experts
        self._vl: dict[str, _VLTensor] = {}
        self._qkv_cache: tuple[str, tuple[torch.Tensor, ...]] | None = None
        self._block_cache: tuple[tuple[str, int], torch.Tensor] | None = None
        for name, t in store.tensors.items():
            try:
                rule, layer, local_e = match_megatron(name)
            except UnmappedTensorError as exc:
                raise TensorMismatchError(f"{t.path}: {exc.args[0]}") from None
            hf = hf_names(rule, layer)
            if rule.kind == "copy":
                self._add(hf[0], _VLTensor("copy", t.shape, t.dtype, source=name))
            elif rule.kind == "qkv":
                q_rows = num_heads * head_dim
                kv_rows = num_query_groups * head_dim
                hidden = t.shape[-1]
                for i, (vl, rows) in enumerate(zip(hf, (q_rows, kv_rows, kv_rows), strict=True)):
                    self._add(vl, _VLTensor("qkv", (rows, hidden), t.dtype, name, qkv_index=i))
            elif rule.kind in ("fc1_grouped", "fc2_grouped"):
                fused = "gate_up" if rule.kind == "fc1_grouped" else "down"
                self._add(hf[0], _VLTensor("grouped", t.shape, t.dtype, name, fused=fused))
            else:  # per-expert SequentialMLP weights: fc1 [2I, H], fc2 [H, I]
                assert local_e is not None
                fused = "gate_up" if rule.kind == "fc1_expert" else "down"
                rows, cols = t.shape
                vl = self._vl.setdefault(
                    hf[0], _VLTensor("expert", (num_experts, cols, rows), t.dtype, fused=fused)
                )
                if local_e in vl.experts:
                    raise TensorMismatchError(f"{name}: expert {local_e} stored twice")
                vl.experts[local_e] = name
        for vl_name, vl in self._vl.items():
            if vl.kind == "expert":
                missing = sorted(set(range(num_experts)) - set(vl.experts))
                if missing or len(vl.experts) != num_experts:
                    raise TensorMismatchError(
                        f"Megatron checkpoint lacks experts {missing[:8]} of {vl_name!r} "
                        f"(has {len(vl.experts)} of {num_experts}; an expert-parallel shard?)"
                    )

    def _add(self, vl_name: str, spec: _VLTensor) -> None:
        if vl_name in self._vl:
            raise TensorMismatchError(f"two Megatron tensors map to {vl_name!r}")
        self._vl[vl_name] = spec

    # -- TrainedWeights
    def names(self) -> list[str]:
        return list(self._vl)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._vl[name].shape

    def dtype(self, name: str) -> torch.dtype:
        return self._vl[name].dtype

    def tensor(self, name: str) -> Piece:
        vl = self._vl[name]
        assert vl.source is not None
        if vl.kind == "copy":
            return self.store[vl.source].range()
        if vl.kind != "qkv":
            raise ValueError(f"{name} is a fused expert tensor; read it per expert")
        if self._qkv_cache is None or self._qkv_cache[0] != vl.source:
            full = self.store.read(vl.source)
            self._qkv_cache = (vl.source, unpack_qkv(full, **self.dims))
        return self._qkv_cache[1][vl.qkv_index].contiguous()

    def hub_expert(self, name: str, expert: int, part: ExpertPart) -> Piece:
        vl = self._vl[name]
        if vl.kind == "expert":  # fc1 [2I, H] = gate rows then up rows; fc2 [H, I] = hub down
            return expert_row_half(self.store[vl.experts[expert]].range(), part)
        assert vl.source is not None
        key = (vl.source, expert)
        if self._block_cache is None or self._block_cache[0] != key:
            self._block_cache = (key, self.store[vl.source].range(expert).read())
        return hub_from_vl_block(self._block_cache[1], part)

    def vl_block(self, name: str, expert: int) -> Piece:
        vl = self._vl[name]
        if vl.kind == "expert":
            block = self.store[vl.experts[expert]].range().read()
            return block.T.contiguous()
        assert vl.source is not None
        return self.store[vl.source].range(expert)


def is_megatron_name(name: str) -> bool:
    try:
        match_megatron(name)
    except UnmappedTensorError:
        return False
    return True


__all__ = ["FileRange", "MegatronTrained", "is_megatron_name"]
