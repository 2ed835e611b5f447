"""Writing trained thinker weights back into a full checkpoint: the inverse of extraction.

``export_trained(base, dst, trained, fmt="omni"|"vl")`` streams:

* ``omni``: every tensor of the base Qwen3-Omni hub checkpoint, in the base's order and (by
  default) the base's own shard files, with each thinker tensor the trainer holds replaced by the
  trained one mapped back through :data:`omni_extract.names.NAME_TABLE` (fused experts split back
  into the base's per-expert matrices). Everything else — the audio tower, talker, code2wav, any
  frozen part — is copied from the base byte for byte (``sendfile``). Non-weight files (config,
  tokenizer, processor, chat template, generation config) are copied too.
* ``vl``: the pseudo-Qwen3-VL-MoE checkpoint omni-extract would write from the base, with the
  trained tensors in place of the base's.

Why this lives in the leaf: it needs nothing of the trainer, only the name table, the base's
headers and a :class:`omni_extract.trained.TrainedWeights` reader; omni-grpo adds the run-dir and
checkpoint-format knowledge on top.

Safety: every trained tensor must land on a base tensor of the same shape (the first mismatch is
named) and the base itself must be a consistent Qwen3-Omni checkpoint, all checked from headers
before a byte is written. The output is built in a hidden sibling and renamed at the end; a marker
file (``omni_export.json``) records what was written, and ``overwrite`` refuses to replace a
directory without one (it might be the user's only copy of something else).
Memory: pass-through bytes never enter Python; a converted piece is one tensor (one expert matrix
for experts), so peak RSS stays near the largest single tensor, far below one shard.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from omni_extract import configs
from omni_extract.artifacts import copy_processor_artifacts
from omni_extract.convert import (
    SourceInputs,
    check_destination,
    check_outside_source,
    emit_output_tensor,
    install_dir,
    output_shard_names,
    write_shards,
)
from omni_extract.errors import (
    DestinationExistsError,
    ExtractError,
    NotAnExportError,
    TensorMismatchError,
)
from omni_extract.names import NAME_TABLE, ExpertPart, match
from omni_extract.plan import (
    DTYPE_CHOICES,
    DtypeChoice,
    OutputTensor,
    assign_shards,
    build_plan,
    validate_thinker,
)
from omni_extract.source import INDEX_FILE, OmniSource, open_source
from omni_extract.trained import FileRange, Piece, TrainedWeights
from omni_extract.writer import PlannedTensor, ShardWriter, tensor_bytes

ExportFormat = Literal["omni", "vl"]
EXPORT_FORMATS: tuple[ExportFormat, ...] = ("omni", "vl")
MARKER_FILE = "omni_export.json"
MARKER_VERSION = 1
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
ProgressFn = Callable[[int, int], None]


@dataclass
class ExportTensor:
    """One output tensor: from the base (``base``, via extraction's emitter) or trained."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    base: OutputTensor | None = None
    trained: str | None = None  # pseudo-VL name in the trained weights
    expert: int | None = None
    part: ExpertPart | None = None  # per-expert hub matrix of a fused trained tensor
    whole_fused: bool = False  # a fused tensor written whole (vl format)

    @property
    def planned(self) -> PlannedTensor:
        return PlannedTensor(self.name, self.dtype, self.shape)


@dataclass
class ExportPlan:
    fmt: ExportFormat
    tensors: list[ExportTensor]
    shards: list[list[ExportTensor]]
    shard_names: list[str]
    replaced: int = 0
    trained_used: set[str] = field(default_factory=set)

    @property
    def total_bytes(self) -> int:
        return sum(t.planned.nbytes for t in self.tensors)

    @property
    def outputs(self) -> list[ExportTensor]:  # the name omni_extract.progress counts
        return self.tensors


@dataclass(frozen=True)
class ExportResult:
    dst: Path
    fmt: ExportFormat
    num_tensors: int
    num_replaced: int
    num_bytes: int
    shards: tuple[str, ...]


# ----------------------------------------------------------------------------- matching


@dataclass(frozen=True)
class _Target:
    """Where one trained tensor goes in the base: a plain hub tensor, or per-expert hub matrices."""

    vl_name: str
    hub: str | None  # plain tensors
    experts: dict[str, tuple[int, ExpertPart]]  # hub name -> (expert, part), fused tensors


def _expected_fused_shape(source: OmniSource, vl_name: str, kind: str, layer: str) -> tuple:
    num_experts = int(source.thinker_config["text_config"]["num_experts"])
    part: ExpertPart = "gate" if kind == "gate_up" else "down"
    row = next(r for r in _EXPERT_ROWS if r.fuse == part)
    assert row.hub is not None
    first = row.hub.format(layer=layer, expert=0)
    t = source.tensors.get(first)
    if t is None:
        raise TensorMismatchError(
            f"trained tensor {vl_name!r} has no counterpart in the base {source.root}: it lacks "
            f"{first!r} (is --base the checkpoint this run was trained from?)"
        )
    rows, cols = t.shape  # gate [I, H]; down [H, I]
    return (num_experts, cols, 2 * rows) if kind == "gate_up" else (num_experts, cols, rows)


_EXPERT_ROWS = [r for r in NAME_TABLE if r.fuse is not None]
_PARTS_OF: dict[str, tuple[ExpertPart, ...]] = {"gate_up": ("gate", "up"), "down": ("down",)}


def match_trained(source: OmniSource, trained: TrainedWeights) -> list[_Target]:
    """Place every trained tensor on base tensors of the same shape, or name the first that fails."""
    targets = []
    for name in trained.names():
        found = match(name, "vl")
        if found is None:
            raise TensorMismatchError(
                f"trained tensor {name!r} is not a pseudo-VL thinker name "
                "(omni_extract.names.NAME_TABLE); refusing to drop it"
            )
        shape = tuple(trained.shape(name))
        if found.row.fused is not None:
            layer = found.groups["layer"]
            want = _expected_fused_shape(source, name, found.row.fused, layer)
            if shape != want:
                raise TensorMismatchError(
                    f"trained tensor {name!r} has shape {list(shape)} (VL hub layout), the base "
                    f"{source.root} implies {list(want)}"
                )
            experts: dict[str, tuple[int, ExpertPart]] = {}
            for part in _PARTS_OF[found.row.fused]:
                row = next(r for r in _EXPERT_ROWS if r.fuse == part)
                assert row.hub is not None
                for e in range(shape[0]):
                    hub = row.hub.format(layer=layer, expert=e)
                    if hub not in source.tensors:
                        raise TensorMismatchError(
                            f"trained tensor {name!r}: the base {source.root} lacks {hub!r}"
                        )
                    experts[hub] = (e, part)
            targets.append(_Target(name, None, experts))
            continue
        hub = found.name_in("hub")
        base = source.tensors.get(hub) if hub is not None else None
        if base is None:
            raise TensorMismatchError(
                f"trained tensor {name!r} has no counterpart {hub!r} in the base {source.root} "
                "(is --base the checkpoint this run was trained from?)"
            )
        if base.shape != shape:
            raise TensorMismatchError(
                f"trained tensor {name!r} has shape {list(shape)}, the base's {hub!r} has "
                f"{list(base.shape)} (is --base the checkpoint this run was trained from?)"
            )
        targets.append(_Target(name, hub, {}))
    return targets


# ----------------------------------------------------------------------------- planning


def build_export_plan(
    source: OmniSource,
    trained: TrainedWeights,
    fmt: ExportFormat = "omni",
    dtype: DtypeChoice = "keep",
    shard_size: int | None = None,
) -> ExportPlan:
    """Every output tensor and its shard, from headers only; raises on any mismatch.

    ``dtype="keep"`` keeps each tensor in the base's dtype (trained tensors are cast to it), so the
    output has the base's layout byte count for byte count. ``shard_size=None`` keeps the base's
    own shard files (``omni``) or extraction's default size (``vl``).
    """
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"format must be one of {EXPORT_FORMATS}, got {fmt!r}")
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {tuple(DTYPE_CHOICES)}, got {dtype!r}")
    if shard_size is not None and shard_size <= 0:
        raise ValueError(f"shard_size must be positive, got {shard_size}")
    validate_thinker(source)  # the base itself must be a consistent Omni checkpoint
    targets = match_trained(source, trained)
    if fmt == "omni":
        return _plan_omni(source, targets, dtype, shard_size)
    return _plan_vl(source, targets, dtype, shard_size)


def _plan_omni(
    source: OmniSource, targets: list[_Target], dtype: DtypeChoice, shard_size: int | None
) -> ExportPlan:
    cast = DTYPE_CHOICES[dtype]
    by_hub: dict[str, tuple[str, int | None, ExpertPart | None]] = {}
    for t in targets:
        if t.hub is not None:
            by_hub[t.hub] = (t.vl_name, None, None)
        for hub, (e, part) in t.experts.items():
            by_hub[hub] = (t.vl_name, e, part)
    ordered = sorted(source.tensors.values(), key=lambda s: (s.file_index, s.offset))
    tensors: list[ExportTensor] = []
    for order, src in enumerate(ordered):
        out_dtype = cast or src.dtype
        hit = by_hub.get(src.name)
        if hit is None:
            base = OutputTensor(
                src.name, out_dtype, src.shape, order, last_file=src.file_index, source=src
            )
            tensors.append(ExportTensor(src.name, out_dtype, src.shape, base=base))
        else:
            vl_name, e, part = hit
            tensors.append(
                ExportTensor(src.name, out_dtype, src.shape, trained=vl_name, expert=e, part=part)
            )
    if shard_size is None:  # the base's own files, tensor for tensor
        files = list(source.files)
        groups: dict[str, list[ExportTensor]] = {f: [] for f in files}
        for t, src in zip(tensors, ordered, strict=True):
            groups[src.file].append(t)
        shards = [groups[f] for f in files if groups[f]]
        names = [f for f in files if groups[f]]
    else:
        shards = assign_shards(tensors, shard_size)  # type: ignore[arg-type]
        names = output_shard_names(len(shards))
    replaced = sum(1 for t in tensors if t.trained is not None)
    return ExportPlan("omni", tensors, shards, names, replaced, {t.vl_name for t in targets})


def _plan_vl(
    source: OmniSource, targets: list[_Target], dtype: DtypeChoice, shard_size: int | None
) -> ExportPlan:
    from omni_extract.convert import DEFAULT_SHARD_SIZE

    plan = build_plan(source, "vl", dtype, shard_size or DEFAULT_SHARD_SIZE)
    by_name = {t.vl_name: t for t in targets}
    shards: list[list[ExportTensor]] = []
    tensors: list[ExportTensor] = []
    for shard in plan.shards:
        shards.append([])
        for out in shard:
            hit = by_name.get(out.name)
            if hit is None:
                t = ExportTensor(out.name, out.dtype, out.shape, base=out)
            else:
                t = ExportTensor(
                    out.name, out.dtype, out.shape, trained=out.name, whole_fused=bool(hit.experts)
                )
            shards[-1].append(t)
            tensors.append(t)
    missing = sorted(set(by_name) - {t.name for t in tensors})
    if missing:  # cannot happen for names the table maps to the VL layout; never drop silently
        raise TensorMismatchError(f"trained tensor {missing[0]!r} has no place in the VL layout")
    replaced = sum(1 for t in tensors if t.trained is not None)
    return ExportPlan(
        "vl", tensors, shards, output_shard_names(len(shards)), replaced, set(by_name)
    )


# ----------------------------------------------------------------------------- streaming


def _write_piece(writer: ShardWriter, piece: Piece, dtype: torch.dtype) -> None:
    if isinstance(piece, FileRange) and piece.dtype == dtype:
        fd = os.open(piece.path, os.O_RDONLY)
        try:
            writer.copy_from(fd, piece.offset, piece.nbytes)
        finally:
            os.close(fd)
        return
    tensor = piece.read() if isinstance(piece, FileRange) else piece
    writer.append(tensor_bytes(tensor.to(dtype).contiguous()))


def _emit_trained(
    t: ExportTensor, writer: ShardWriter, trained: TrainedWeights, progress: ProgressFn
) -> None:
    assert t.trained is not None
    writer.begin(t.name, t.dtype, t.shape)
    if t.whole_fused:
        for e in range(t.shape[0]):
            piece = trained.vl_block(t.trained, e)
            _check_piece(t, piece, t.shape[1:])
            _write_piece(writer, piece, t.dtype)
    elif t.part is not None:
        assert t.expert is not None
        piece = trained.hub_expert(t.trained, t.expert, t.part)
        _check_piece(t, piece, t.shape)
        _write_piece(writer, piece, t.dtype)
    else:
        piece = trained.tensor(t.trained)
        _check_piece(t, piece, t.shape)
        _write_piece(writer, piece, t.dtype)
    progress(writer.end(), 1)


def _check_piece(t: ExportTensor, piece: Piece, shape: tuple[int, ...]) -> None:
    if tuple(piece.shape) != tuple(shape):  # a reader bug, never bad input (shapes were planned)
        raise RuntimeError(f"{t.name}: trained piece has shape {list(piece.shape)}, want {shape}")


def stream_export(
    source: OmniSource,
    plan: ExportPlan,
    trained: TrainedWeights,
    out_dir: Path,
    progress: ProgressFn | None = None,
) -> tuple[str, ...]:
    """Write the plan's shards (and an index when the base had one or there are several)."""
    report: ProgressFn = progress or (lambda nbytes, ntensors: None)

    def emit(
        t: ExportTensor, writer: ShardWriter, inputs: SourceInputs, pool: Any, rep: ProgressFn
    ) -> None:
        if t.base is not None:
            emit_output_tensor(t.base, writer, inputs, pool, rep)
        else:
            _emit_trained(t, writer, trained, rep)

    weight_map = write_shards(source, plan.shards, plan.shard_names, out_dir, emit, report)  # type: ignore[arg-type]
    base_indexed = (source.root / INDEX_FILE).is_file()
    if len(plan.shard_names) > 1 or (plan.fmt == "omni" and base_indexed):
        index = {"metadata": {"total_size": plan.total_bytes}, "weight_map": weight_map}
        (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True))
    return tuple(plan.shard_names)


# ----------------------------------------------------------------------------- side files


def _is_weight_file(name: str) -> bool:
    return name.endswith(".safetensors") or name in (INDEX_FILE, MARKER_FILE)


def _copy_side_files(src: Path, dst: Path) -> list[str]:
    """Every non-weight file of the base (config, tokenizer, processor, templates, generation)."""
    copied = []
    for p in sorted(src.iterdir()):
        if p.is_file() and not _is_weight_file(p.name):
            shutil.copyfile(p, dst / p.name)
            copied.append(p.name)
    return copied


def _set_dtype(config: dict[str, Any], name: str) -> None:
    """Point every ``dtype``/``torch_dtype`` field of a (nested) config at ``name``."""
    for key in ("dtype", "torch_dtype"):
        if key in config:
            config[key] = name
    for value in config.values():
        if isinstance(value, dict):
            _set_dtype(value, name)


def _write_side_files(
    source: OmniSource, fmt: ExportFormat, dtype: DtypeChoice, out_dir: Path
) -> None:
    cast = DTYPE_CHOICES[dtype]
    if fmt == "omni":
        _copy_side_files(source.root, out_dir)
        if cast is not None:
            config = json.loads((source.root / "config.json").read_text())
            _set_dtype(config, _DTYPE_NAMES[cast])
            (out_dir / "config.json").write_text(json.dumps(config, indent=2))
        return
    cfg = configs.vl_config(source.config, _DTYPE_NAMES.get(cast) if cast is not None else None)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    copy_processor_artifacts(source.root, out_dir)


# ----------------------------------------------------------------------------- entry point


def check_export_destination(base: Path, dst: Path, overwrite: bool) -> None:
    """``dst`` must be new, empty, or (with ``overwrite``) a directory an export wrote."""
    check_destination(base, dst, overwrite=True)  # refuses dst == base / dst containing base
    check_outside_source(base, dst)
    if not dst.exists():
        return
    if not dst.is_dir():
        raise DestinationExistsError(f"destination {dst} exists and is not a directory")
    if not any(dst.iterdir()):
        return
    if not overwrite:
        raise DestinationExistsError(f"destination {dst} exists; pass --overwrite to replace it")
    if not (dst / MARKER_FILE).is_file():
        raise NotAnExportError(
            f"destination {dst} was not written by an export (no {MARKER_FILE}); refusing to "
            "overwrite it"
        )


def export_trained(
    base: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    trained: TrainedWeights,
    fmt: ExportFormat = "omni",
    dtype: DtypeChoice = "keep",
    shard_size: int | None = None,
    overwrite: bool = False,
    provenance: dict[str, Any] | None = None,
    progress: bool | ProgressFn = False,
) -> ExportResult:
    """Write ``trained`` over the base checkpoint ``base`` into ``dst`` (see the module docstring).

    ``provenance`` (run directory, step, ...) goes into the marker file. ``progress``: ``True``
    for a rich progress bar, or a ``(bytes, tensors)`` callback. Raises an
    :class:`omni_extract.errors.ExtractError` naming the mismatch; ``dst`` is then untouched.
    """
    base_path, dst_path = Path(base), Path(dst)
    check_export_destination(base_path, dst_path, overwrite)
    source = open_source(base_path)
    plan = build_export_plan(source, trained, fmt, dtype, shard_size)
    if not plan.tensors:
        raise ExtractError(f"{base_path}: the export selected zero tensors")
    dst_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst_path.name}.tmp-", dir=dst_path.parent))
    try:
        if progress is True:
            from omni_extract.progress import rich_progress

            with rich_progress(plan, f"{fmt} export -> {dst_path.name}", stderr=True) as cb:  # type: ignore[arg-type]
                shards = stream_export(source, plan, trained, tmp, cb)
        else:
            shards = stream_export(source, plan, trained, tmp, progress or None)
        _write_side_files(source, fmt, dtype, tmp)
        marker = {
            "version": MARKER_VERSION,
            "writer": "omni_extract.export",
            "format": fmt,
            "base": str(base_path.resolve()),
            "dtype": dtype,
            "num_tensors": len(plan.tensors),
            "num_replaced": plan.replaced,
            "num_trained": len(plan.trained_used),
            "total_bytes": plan.total_bytes,
            **(provenance or {}),
        }
        (tmp / MARKER_FILE).write_text(json.dumps(marker, indent=2, default=str))
        install_dir(tmp, dst_path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ExportResult(dst_path, fmt, len(plan.tensors), plan.replaced, plan.total_bytes, shards)
