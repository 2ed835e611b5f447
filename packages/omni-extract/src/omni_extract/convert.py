"""Streaming extraction of a Qwen3-Omni hub checkpoint into a text, pseudo-VL or audio checkpoint.

Memory: input shards are opened lazily with ``safe_open`` (memory-mapped) one at a time and closed
before the next, output shards are streamed tensor by tensor (``writer.ShardWriter``), and expert
fusion builds one layer's fused tensor at a time. Peak RSS is therefore about one input shard of
mapped pages plus the largest single output tensor, independent of the checkpoint size.

Safety: the whole plan is validated from headers before any data is read; the output is written
into a temporary sibling of ``dst`` and renamed into place at the very end; on any error the
temporary directory is removed, so ``dst`` is either the complete result or untouched.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from omni_extract import configs
from omni_extract.artifacts import copy_processor_artifacts
from omni_extract.errors import DestinationExistsError, ExtractError
from omni_extract.plan import (
    DtypeChoice,
    ExtractionPlan,
    OutputTensor,
    Variant,
    build_plan,
)
from omni_extract.source import INDEX_FILE, SINGLE_FILE, OmniSource, open_source
from omni_extract.writer import ShardWriter

DEFAULT_SHARD_SIZE = 5 * 1000**3
SAFETENSORS_METADATA = {"format": "pt"}
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
    "KIB": 1024,
    "MIB": 1024**2,
    "GIB": 1024**3,
}

ProgressFn = Callable[[int, int], None]  # (bytes written, tensors written) since the last call


@dataclass(frozen=True)
class ExtractResult:
    """What was written."""

    dst: Path
    variant: Variant
    num_tensors: int
    num_bytes: int
    shards: tuple[str, ...]


def parse_size(size: int | str) -> int:
    """``5GB``, ``500MB``, ``2GiB`` or a byte count -> bytes."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", size, re.IGNORECASE)
    if not m:
        raise ValueError(f"shard size {size!r}: expected e.g. 5GB, 500MB, 2GiB or a byte count")
    return int(float(m.group(1)) * _SIZE_UNITS[(m.group(2) or "").upper()])


# ----------------------------------------------------------------------------- tensor production


class _ShardReaders:
    """Lazily opened ``safe_open`` handles, all closed when the stream moves to the next shard."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._stack = ExitStack()
        self._open: dict[str, Any] = {}

    def get(self, file: str, name: str) -> torch.Tensor:
        handle = self._open.get(file)
        if handle is None:
            handle = self._stack.enter_context(safe_open(self.root / file, framework="pt"))
            self._open[file] = handle
        return handle.get_tensor(name)

    def close(self) -> None:
        self._open.clear()
        self._stack.close()
        self._stack = ExitStack()


def _materialise(out: OutputTensor, readers: _ShardReaders) -> torch.Tensor:
    if out.source is not None:
        t = readers.get(out.source.file, out.source.name)
        if tuple(t.shape) != out.shape:  # the header lied, or the file changed under us
            raise ExtractError(f"{out.source.file}: {out.source.name} read as {tuple(t.shape)}")
        return t if t.dtype == out.dtype else t.to(out.dtype)
    # Fused experts, VL hub layout: gate_up [E, H, 2I] (gate then up), down [E, I, H].
    buf = torch.empty(out.shape, dtype=out.dtype)
    for src, expert, part in out.parts:
        w = readers.get(src.file, src.name).T  # [I,H] -> [H,I], or down [H,I] -> [I,H]
        if part == "down":
            buf[expert].copy_(w)
        else:
            half = out.shape[2] // 2
            cols = slice(0, half) if part == "gate" else slice(half, 2 * half)
            buf[expert, :, cols].copy_(w)
    return buf


def _shard_names(n: int) -> list[str]:
    if n == 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


def stream_weights(
    source: OmniSource, plan: ExtractionPlan, out_dir: Path, progress: ProgressFn | None = None
) -> tuple[str, ...]:
    """Write the planned tensors into ``out_dir`` as sharded safetensors (+ index if >1 shard)."""
    names = _shard_names(len(plan.shards))
    readers = _ShardReaders(source.root)
    current_file = -1
    weight_map: dict[str, str] = {}
    try:
        for fname, shard in zip(names, plan.shards, strict=True):
            writer = ShardWriter(out_dir / fname, [o.planned for o in shard], SAFETENSORS_METADATA)
            try:
                for out in shard:
                    if out.last_file != current_file:
                        readers.close()  # drop the previous shard's mapped pages
                        current_file = out.last_file
                    tensor = _materialise(out, readers)
                    nbytes = writer.write(out.name, tensor)
                    del tensor
                    weight_map[out.name] = fname
                    if progress is not None:
                        progress(nbytes, 1)
                writer.close()
            except BaseException:
                writer.abort()
                raise
    finally:
        readers.close()
    if len(names) > 1:
        index = {"metadata": {"total_size": plan.total_bytes}, "weight_map": weight_map}
        (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True))
    return tuple(names)


# ----------------------------------------------------------------------------- configs


def _write_config(
    source: OmniSource, variant: Variant, out_dtype: torch.dtype | None, out_dir: Path
) -> None:
    dtype_name = _DTYPE_NAMES.get(out_dtype) if out_dtype is not None else None
    if variant == "vl":
        cfg = configs.vl_config(source.config, dtype_name)
    elif variant == "text":
        gen_path = source.root / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.is_file() else None
        cfg = configs.text_config(source.config, dtype_name, gen)
    else:
        cfg = configs.audio_config(source.config, dtype_name)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))


# ----------------------------------------------------------------------------- public entry point


def _check_destination(src: Path, dst: Path, overwrite: bool) -> None:
    s, d = src.resolve(), dst.resolve()
    if d == s or s.is_relative_to(d):
        raise ExtractError(f"destination {dst} is (or contains) the source {src}; refusing")
    if dst.exists() and not overwrite and (not dst.is_dir() or any(dst.iterdir())):
        raise DestinationExistsError(f"destination {dst} exists; pass overwrite=True (--overwrite)")


def _install(tmp: Path, dst: Path) -> None:
    """Rename the finished temp dir onto ``dst``; an old ``dst`` is moved aside, then deleted."""
    old: Path | None = None
    if dst.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
        os.replace(dst, old / dst.name)
    try:
        os.replace(tmp, dst)
    except BaseException:
        if old is not None:
            os.replace(old / dst.name, dst)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def extract(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    variant: Variant = "vl",
    shard_size: int | str = DEFAULT_SHARD_SIZE,
    dtype: DtypeChoice = "keep",
    overwrite: bool = False,
    progress: bool | ProgressFn = False,
) -> ExtractResult:
    """Convert the Qwen3-Omni checkpoint at ``src`` into ``variant`` at ``dst``.

    ``variant``: ``"vl"`` (pseudo-Qwen3-VL-MoE), ``"text"`` (``qwen3_moe``) or ``"audio"`` (tower).
    ``shard_size``: bytes or ``"5GB"``-style. ``dtype``: ``"keep"``, ``"bf16"`` or ``"fp32"``.
    ``progress``: ``True`` for a rich progress bar, or a callback ``(bytes, tensors)``.
    Raises an ``omni_extract.errors.ExtractError`` subclass naming the bad file/key; on any error
    nothing is left at ``dst`` (or the previous ``dst`` is kept).
    """
    src_path, dst_path = Path(src), Path(dst)
    _check_destination(src_path, dst_path, overwrite)
    source = open_source(src_path)
    plan = build_plan(source, variant, dtype, parse_size(shard_size))
    cast = None if dtype == "keep" else plan.outputs[0].dtype

    dst_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst_path.name}.tmp-", dir=dst_path.parent))
    try:
        if progress is True:
            from omni_extract.progress import rich_progress

            with rich_progress(plan, f"{variant} <- {src_path.name}") as cb:
                shards = stream_weights(source, plan, tmp, cb)
        else:
            shards = stream_weights(source, plan, tmp, progress or None)
        _write_config(source, variant, cast, tmp)
        copy_processor_artifacts(src_path, tmp)
        _install(tmp, dst_path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ExtractResult(dst_path, variant, len(plan.outputs), plan.total_bytes, shards)
