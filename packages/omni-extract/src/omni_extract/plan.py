"""Planning an extraction from tensor headers alone: what to write, in which order, in which shard.

Everything that can fail on bad input fails here, before a byte is written: unmapped names, tensors
the config does not imply, wrong shapes, missing experts, an empty selection.

Order: output tensors are produced in the order of the LAST input shard they need, so cold reads
go shard after shard; a layer whose experts straddle two shards is fused once the later shard is
reached (its experts are read positionally from both, see ``convert.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from omni_extract.errors import (
    EmptySelectionError,
    MissingExpertError,
    TensorMismatchError,
)
from omni_extract.expected import expected_thinker_tensors
from omni_extract.names import NAME_TABLE, ExpertPart, FusedKind, NameRow, match_hub
from omni_extract.source import OmniSource, SourceTensor
from omni_extract.writer import PlannedTensor

Variant = Literal["text", "vl", "audio"]
VARIANTS: tuple[Variant, ...] = ("text", "vl", "audio")
DtypeChoice = Literal["keep", "bf16", "fp32"]
DTYPE_CHOICES: dict[str, torch.dtype | None] = {
    "keep": None,
    "bf16": torch.bfloat16,
    "fp32": torch.float32,
}
# Which fused tensor each per-expert projection joins, in the VL layout.
FUSED_OF: dict[ExpertPart, FusedKind] = {"gate": "gate_up", "up": "gate_up", "down": "down"}
FUSED_ROWS: dict[FusedKind, NameRow] = {r.fused: r for r in NAME_TABLE if r.fused is not None}


@dataclass
class OutputTensor:
    """One tensor of the output and the hub tensors it is made of.

    ``parts`` is empty for a plain copy (then ``source`` is the one hub tensor); for a fused
    expert tensor it lists ``(hub name, expert index, projection)`` for every expert.
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    order: int  # first appearance in the input, to keep the output deterministic
    last_file: int = 0
    source: SourceTensor | None = None
    fused: FusedKind | None = None
    parts: list[tuple[SourceTensor, int, ExpertPart]] = field(default_factory=list)

    @property
    def planned(self) -> PlannedTensor:
        return PlannedTensor(self.name, self.dtype, self.shape)

    @property
    def input_nbytes(self) -> int:
        if self.source is not None:
            return self.source.nbytes
        return sum(p[0].nbytes for p in self.parts)


@dataclass
class ExtractionPlan:
    variant: Variant
    outputs: list[OutputTensor]
    shards: list[list[OutputTensor]]

    @property
    def total_bytes(self) -> int:
        return sum(o.planned.nbytes for o in self.outputs)

    @property
    def total_input_bytes(self) -> int:
        return sum(o.input_nbytes for o in self.outputs)


def validate_thinker(source: OmniSource) -> None:
    """Every thinker tensor must be one the config implies, with the implied shape, and vice versa."""
    expected = expected_thinker_tensors(source.thinker_config)
    for name, t in source.tensors.items():
        found = match_hub(name)  # raises on names no row knows
        if found.row.key == "talker":
            continue
        want = expected.get(name)
        if want is None:
            raise TensorMismatchError(
                f"{t.file}: tensor {name!r} is not part of the thinker that config.json describes "
                f"({found.row.key} row; check num_hidden_layers / num_experts / depth)"
            )
        if t.shape != want:
            raise TensorMismatchError(
                f"{t.file}: tensor {name!r} has shape {list(t.shape)}, config.json implies {list(want)}"
            )
    missing = sorted(set(expected) - set(source.tensors))
    if not missing:
        return
    first = match_hub(missing[0])
    if first.row.fuse is not None:
        g = first.groups
        raise MissingExpertError(
            f"layer {g['layer']} lacks expert {g['expert']} {first.row.fuse}_proj "
            f"({missing[0]!r}); {len(missing)} expected thinker tensor(s) missing in {source.root}"
        )
    raise TensorMismatchError(
        f"{len(missing)} thinker tensor(s) implied by config.json are missing from {source.root}: "
        f"{missing[:5]}{' ...' if len(missing) > 5 else ''}"
    )


def build_plan(
    source: OmniSource, variant: Variant, dtype: DtypeChoice = "keep", shard_size: int = 5 * 1024**3
) -> ExtractionPlan:
    """Decide every output tensor and its shard, from headers only."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {tuple(DTYPE_CHOICES)}, got {dtype!r}")
    if shard_size <= 0:
        raise ValueError(f"shard_size must be positive, got {shard_size}")
    cast = DTYPE_CHOICES[dtype]
    num_experts = int(source.thinker_config["text_config"]["num_experts"])

    outputs: dict[str, OutputTensor] = {}
    for order, (name, t) in enumerate(source.tensors.items()):
        found = match_hub(name)
        out_dtype = cast or t.dtype
        if variant == "vl" and found.row.fuse is not None:
            part = found.row.fuse
            kind = FUSED_OF[part]
            fused_row = FUSED_ROWS[kind]
            assert fused_row.vl is not None
            out_name = fused_row.vl.format(layer=found.groups["layer"])
            rows, cols = t.shape  # gate/up [I, H], down [H, I]
            shape = (
                (num_experts, cols, 2 * rows) if kind == "gate_up" else (num_experts, cols, rows)
            )
            out = outputs.setdefault(
                out_name, OutputTensor(out_name, out_dtype, shape, order, fused=kind)
            )
            if out.dtype != out_dtype:
                raise TensorMismatchError(
                    f"{t.file}: expert tensor {name!r} is {t.dtype}, other experts of {out_name} are "
                    f"{out.dtype}; use --dtype bf16|fp32 to unify"
                )
            out.parts.append((t, int(found.groups["expert"]), part))
            out.last_file = max(out.last_file, t.file_index)
            continue
        out_name = found.name_in(variant)
        if out_name is None:
            continue
        outputs[out_name] = OutputTensor(
            out_name, out_dtype, t.shape, order, last_file=t.file_index, source=t
        )
    if not outputs:
        raise EmptySelectionError(
            f"variant {variant!r} selected zero tensors from {source.root} "
            f"({len(source.tensors)} tensors in {len(source.files)} shard(s))"
        )
    validate_thinker(source)  # after the selection, so "nothing selected" is reported as such
    ordered = sorted(outputs.values(), key=lambda o: (o.last_file, o.order))
    return ExtractionPlan(variant, ordered, assign_shards(ordered, shard_size))


def assign_shards(outputs: list[OutputTensor], shard_size: int) -> list[list[OutputTensor]]:
    """Greedy packing in production order; a tensor larger than ``shard_size`` gets its own shard."""
    shards: list[list[OutputTensor]] = [[]]
    size = 0
    for out in outputs:
        n = out.planned.nbytes
        if shards[-1] and size + n > shard_size:
            shards.append([])
            size = 0
        shards[-1].append(out)
        size += n
    return shards
