"""Streaming extraction of a Qwen3-Omni hub checkpoint into a text, pseudo-VL or audio checkpoint.

Memory: nothing is memory-mapped. Tensors that pass through unchanged go from the input shard to
the output shard with ``sendfile`` (in the kernel, like ``cp``); fused experts are built and
written one expert at a time (each expert's block is contiguous in the VL layout), read with
``pread`` from whichever shard holds it — so a layer whose experts straddle shards costs nothing
extra. Only a dtype conversion holds a whole tensor. Peak RSS is therefore the interpreter plus
one tensor at most, far below "one input shard + one output shard", at any checkpoint size.
The plan still streams in input-shard order, so cold reads stay sequential.

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
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import torch

from omni_extract import configs
from omni_extract.artifacts import copy_processor_artifacts
from omni_extract.errors import DestinationExistsError, ExtractError
from omni_extract.kernels import pread_into, scratch, transpose_into
from omni_extract.plan import (
    DtypeChoice,
    ExtractionPlan,
    OutputTensor,
    Variant,
    build_plan,
)
from omni_extract.source import INDEX_FILE, SINGLE_FILE, OmniSource, SourceTensor, open_source
from omni_extract.writer import ShardWriter, pwrite_all, tensor_bytes

DEFAULT_SHARD_SIZE = 5 * 1000**3
# Threads that build fused-expert blocks ahead of the writer.
FUSE_THREADS = max(1, min(4, os.cpu_count() or 1))
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


class _Inputs:
    """Raw read-only descriptors of all input shards (opened up front: worker threads share them,
    and positional reads need no locking)."""

    def __init__(self, root: Path, files: tuple[str, ...]) -> None:
        self._fds: dict[str, int] = {}
        try:
            for f in files:
                self._fds[f] = os.open(root / f, os.O_RDONLY)
        except BaseException:
            self.close()
            raise

    def fd(self, file: str) -> int:
        return self._fds[file]

    def read(self, src: SourceTensor, into: torch.Tensor | None = None) -> torch.Tensor:
        buf = torch.empty(src.shape, dtype=src.dtype) if into is None else into
        return pread_into(self.fd(src.file), buf, src.offset)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _fused_block(
    out: OutputTensor, by_part: dict, expert: int, inputs: _Inputs, fd: int, offset: int
) -> None:
    """Build one expert's contiguous block of a fused tensor and ``pwrite`` it at ``offset``.

    gate_up [E, H, 2I]: block [H, 2I] = (gate_e.T | up_e.T); down [E, I, H]: block = down_e.T.
    Runs in a worker thread; every buffer is a per-thread scratch, reused across experts.
    """
    block = scratch("block", out.shape[1:], out.dtype)
    if out.fused == "down":
        transpose_into(block, _read_scratch(inputs, by_part[expert, "down"]))
    else:
        half = out.shape[2] // 2
        transpose_into(block[:, :half], _read_scratch(inputs, by_part[expert, "gate"]))
        transpose_into(block[:, half:], _read_scratch(inputs, by_part[expert, "up"]))
    pwrite_all(fd, tensor_bytes(block), offset)


def _read_scratch(inputs: _Inputs, src: SourceTensor) -> torch.Tensor:
    return inputs.read(src, scratch("read", src.shape, src.dtype))


def _emit(
    out: OutputTensor,
    writer: ShardWriter,
    inputs: _Inputs,
    pool: ThreadPoolExecutor,
    progress: ProgressFn,
) -> None:
    """Stream one output tensor into ``writer``; at most a few experts' matrices are in memory.

    Reports bytes to ``progress`` as they are written (per expert for fused tensors, which are
    ~0.8 GB each in the real model) and the tensor once it is complete.
    """
    writer.begin(out.name, out.dtype, out.shape)
    if out.source is not None:
        src = out.source
        if src.dtype == out.dtype:  # pass-through: a kernel-side copy, like cp
            writer.copy_from(inputs.fd(src.file), src.offset, src.nbytes)
        else:
            writer.append(tensor_bytes(inputs.read(src).to(out.dtype)))
        progress(writer.end(), 1)
        return
    # Fused experts: each expert's block is contiguous in the output, so worker threads read,
    # transpose and pwrite whole blocks in parallel (pread/pwrite and numpy copies release the
    # GIL). At most 2 x FUSE_THREADS experts are in flight.
    by_part = {(expert, part): src for src, expert, part in out.parts}
    fd, base = writer.reserve()
    block_bytes = out.planned.nbytes // out.shape[0]
    pending: deque[Future[None]] = deque()
    try:
        for expert in range(out.shape[0]):
            offset = base + expert * block_bytes
            pending.append(pool.submit(_fused_block, out, by_part, expert, inputs, fd, offset))
            if len(pending) >= 2 * FUSE_THREADS:
                pending.popleft().result()
                progress(block_bytes, 0)
        while pending:
            pending.popleft().result()
            progress(block_bytes, 0)
    finally:
        for fut in pending:  # on error: let in-flight blocks finish before the file is closed
            fut.cancel()
        wait(pending)
    writer.end()
    progress(0, 1)


def _shard_names(n: int) -> list[str]:
    if n == 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


def stream_weights(
    source: OmniSource, plan: ExtractionPlan, out_dir: Path, progress: ProgressFn | None = None
) -> tuple[str, ...]:
    """Write the planned tensors into ``out_dir`` as sharded safetensors (+ index if >1 shard)."""
    names = _shard_names(len(plan.shards))
    report: ProgressFn = progress or (lambda nbytes, ntensors: None)
    inputs = _Inputs(source.root, source.files)
    pool = ThreadPoolExecutor(max_workers=FUSE_THREADS, thread_name_prefix="omni-extract")
    weight_map: dict[str, str] = {}
    try:
        for fname, shard in zip(names, plan.shards, strict=True):
            writer = ShardWriter(out_dir / fname, [o.planned for o in shard], SAFETENSORS_METADATA)
            try:
                for out in shard:
                    _emit(out, writer, inputs, pool, report)
                    weight_map[out.name] = fname
                writer.close()
            except BaseException:
                writer.abort()
                raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        inputs.close()
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
