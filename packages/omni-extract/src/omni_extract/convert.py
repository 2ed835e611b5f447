"""Streaming extraction of a Qwen3-Omni hub checkpoint into a text, pseudo-VL or audio checkpoint.

Memory: tensors that pass through unchanged go from the input shard to the output shard with
``sendfile`` (in the kernel, like ``cp``); fused experts are built one expert at a time (each
expert's block is contiguous in the VL layout), transposed straight from a read-only map of
whichever shard holds each matrix into a shared map of the output region — so each byte is moved
once, and a layer whose experts straddle shards costs nothing extra. Each range is dropped from
both maps once done (the pages stay in the page cache, but no longer count toward our RSS). Only
a dtype conversion holds a whole tensor. Peak RSS is therefore the interpreter plus one tensor at
most, far below "one input shard + one output shard", at any checkpoint size.
The plan still streams in input-shard order, so cold reads stay sequential.

Safety: the whole plan is validated from headers before any data is read; the output is written
into a temporary sibling of ``dst`` and renamed into place at the very end; on any error the
temporary directory is removed, so ``dst`` is either the complete result or untouched.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import re
import shutil
import tempfile
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from omni_extract import configs
from omni_extract.artifacts import copy_processor_artifacts
from omni_extract.errors import (
    CorruptShardError,
    DestinationExistsError,
    ExtractError,
    NotQwen3OmniError,
)
from omni_extract.kernels import pread_into, scratch, transpose_bits_into
from omni_extract.plan import (
    DtypeChoice,
    ExtractionPlan,
    OutputTensor,
    Variant,
    build_plan,
)
from omni_extract.source import (
    INDEX_FILE,
    SINGLE_FILE,
    OmniSource,
    SourceTensor,
    load_json,
    open_source,
)
from omni_extract.writer import MappedRegion, ShardWriter, tensor_bytes

DEFAULT_SHARD_SIZE = 5 * 1000**3
# Threads that build fused-expert blocks ahead of the writer.
FUSE_THREADS = max(1, min(4, os.cpu_count() or 1))
SAFETENSORS_METADATA = {"format": "pt"}
_INT_OF_SIZE = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}
_TORCH_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
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
    n = int(float(m.group(1)) * _SIZE_UNITS[(m.group(2) or "").upper()])
    if n < 1:
        raise ValueError(f"shard size {size!r}: must be at least 1 byte")
    return n


# ----------------------------------------------------------------------------- tensor production


class SourceInputs:
    """Raw read-only descriptors and read-only maps of all input shards (opened up front: worker
    threads share them, and positional reads need no locking).

    Fused experts are transposed straight from the mapped page-cache pages (``mapped``), which
    saves one full copy per byte versus ``pread`` into a buffer. Mapped file pages count toward
    RSS while mapped, so each range is dropped from the mapping (``release``) once used; the
    pages stay in the page cache.
    """

    def __init__(self, root: Path, files: tuple[str, ...]) -> None:
        self._root = root
        self._fds: dict[str, int] = {}
        self._maps: dict[str, mmap.mmap] = {}
        try:
            for f in files:
                self._fds[f] = fd = os.open(root / f, os.O_RDONLY)
                if os.fstat(fd).st_size:
                    self._maps[f] = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        except BaseException:
            self.close()
            raise

    def fd(self, file: str) -> int:
        return self._fds[file]

    def read(self, src: SourceTensor, into: torch.Tensor | None = None) -> torch.Tensor:
        buf = torch.empty(src.shape, dtype=src.dtype) if into is None else into
        return pread_into(self.fd(src.file), buf, src.offset)

    def mapped(self, src: SourceTensor) -> np.ndarray:
        """``src``'s bytes as a read-only integer array over the mapped shard (no copy)."""
        mm = self._maps.get(src.file)
        size = 0 if mm is None else len(mm)
        if src.offset + src.nbytes > size:
            raise CorruptShardError(
                f"{self._root / src.file}: tensor {src.name!r} needs bytes up to "
                f"{src.offset + src.nbytes}, but the file has {size} (truncated?)"
            )
        dtype = _INT_OF_SIZE[src.dtype.itemsize]
        count = src.nbytes // src.dtype.itemsize
        return np.frombuffer(mm, dtype, count, src.offset).reshape(src.shape)

    def release(self, src: SourceTensor) -> None:
        """Drop ``src``'s pages from this process's mapping (not from the page cache)."""
        start = src.offset - src.offset % mmap.PAGESIZE
        self._maps[src.file].madvise(mmap.MADV_DONTNEED, start, src.offset + src.nbytes - start)

    def close(self) -> None:
        for mm in self._maps.values():
            # An array from a failed worker may still be alive; the GC unmaps it then.
            with contextlib.suppress(BufferError):
                mm.close()
        self._maps.clear()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _fused_block(
    out: OutputTensor, by_part: dict, expert: int, inputs: SourceInputs, region: MappedRegion
) -> None:
    """Build one expert's contiguous block of a fused tensor in place, in the mapped output.

    gate_up [E, H, 2I]: block [H, 2I] = (gate_e.T | up_e.T); down [E, I, H]: block = down_e.T.
    Runs in a worker thread; source and destination are both mapped pages, so each byte is moved
    once by the transpose (no read buffer, no write buffer).
    """
    block_bytes = out.planned.nbytes // out.shape[0]
    offset = expert * block_bytes
    block = region.array(offset, _INT_OF_SIZE[out.dtype.itemsize], out.shape[1:])
    if out.fused == "down":
        _transpose_part(block, inputs, by_part[expert, "down"], out.dtype)
    else:
        half = out.shape[2] // 2
        _transpose_part(block[:, :half], inputs, by_part[expert, "gate"], out.dtype)
        _transpose_part(block[:, half:], inputs, by_part[expert, "up"], out.dtype)
    del block
    region.release(offset, block_bytes)


def _transpose_part(
    dst: np.ndarray, inputs: SourceInputs, src: SourceTensor, dtype: torch.dtype
) -> None:
    """``dst[:] = src.T`` as ``dtype`` bits: from the mapped shard when no conversion is needed."""
    if src.dtype != dtype:
        converted = inputs.read(src, scratch("read", src.shape, src.dtype)).to(dtype)
        transpose_bits_into(dst, converted.view(_TORCH_INT_OF_SIZE[dtype.itemsize]).numpy())
        return
    transpose_bits_into(dst, inputs.mapped(src))
    inputs.release(src)


def emit_output_tensor(
    out: OutputTensor,
    writer: ShardWriter,
    inputs: SourceInputs,
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
    # Fused experts: each expert's block is contiguous in the output, so worker threads transpose
    # whole blocks from the mapped input into the mapped output in parallel (numpy copies release
    # the GIL). At most 2 x FUSE_THREADS experts are in flight.
    by_part = {(expert, part): src for src, expert, part in out.parts}
    fd, base = writer.reserve()
    block_bytes = out.planned.nbytes // out.shape[0]
    region = MappedRegion(fd, base, out.planned.nbytes)
    pending: deque[Future[None]] = deque()
    try:
        for expert in range(out.shape[0]):
            pending.append(pool.submit(_fused_block, out, by_part, expert, inputs, region))
            if len(pending) >= 2 * FUSE_THREADS:
                pending.popleft().result()
                progress(block_bytes, 0)
        while pending:
            pending.popleft().result()
            progress(block_bytes, 0)
    finally:
        for fut in pending:  # on error: let in-flight blocks finish before the map is closed
            fut.cancel()
        wait(pending)
        region.close()
    writer.end()
    progress(0, 1)


def output_shard_names(n: int) -> list[str]:
    if n == 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


EmitFn = Callable[[object, ShardWriter, "SourceInputs", ThreadPoolExecutor, ProgressFn], None]


def write_shards(
    source: OmniSource,
    shards: list[list],
    names: list[str],
    out_dir: Path,
    emit: EmitFn,
    report: ProgressFn,
) -> dict[str, str]:
    """Write each shard with a streaming writer, ``emit`` producing each planned tensor's bytes;
    return the weight map. Shared by extraction and export (``omni_extract.export``)."""
    inputs = SourceInputs(source.root, source.files)
    pool = ThreadPoolExecutor(max_workers=FUSE_THREADS, thread_name_prefix="omni-extract")
    weight_map: dict[str, str] = {}
    try:
        for fname, shard in zip(names, shards, strict=True):
            writer = ShardWriter(out_dir / fname, [o.planned for o in shard], SAFETENSORS_METADATA)
            try:
                for out in shard:
                    emit(out, writer, inputs, pool, report)
                    weight_map[out.name] = fname
                writer.close()
            except BaseException:
                writer.abort()
                raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        inputs.close()
    return weight_map


def stream_weights(
    source: OmniSource, plan: ExtractionPlan, out_dir: Path, progress: ProgressFn | None = None
) -> tuple[str, ...]:
    """Write the planned tensors into ``out_dir`` as sharded safetensors (+ index if >1 shard)."""
    names = output_shard_names(len(plan.shards))
    report: ProgressFn = progress or (lambda nbytes, ntensors: None)
    weight_map = write_shards(source, plan.shards, names, out_dir, emit_output_tensor, report)
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
        gen = load_json(gen_path, NotQwen3OmniError) if gen_path.is_file() else None
        cfg = configs.text_config(source.config, dtype_name, gen)
    else:
        cfg = configs.audio_config(source.config, dtype_name)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))


# ----------------------------------------------------------------------------- public entry point


# Written into every output: ``--overwrite`` replaces only a directory that holds it (or an
# empty one), never a regular file or a directory someone else filled.
MARKER_FILE = "omni_extract.json"
# Markers of every directory our tools write (``omni_export.json``: omni_extract.export).
OWN_MARKERS: tuple[str, ...] = (MARKER_FILE, "omni_export.json")


def check_destination(src: Path, dst: Path, overwrite: bool) -> None:
    s, d = src.resolve(), dst.resolve()
    if d == s or s.is_relative_to(d):
        raise ExtractError(f"destination {dst} is (or contains) the source {src}; refusing")
    if dst.exists() and not overwrite and (not dst.is_dir() or any(dst.iterdir())):
        raise DestinationExistsError(f"destination {dst} exists; pass overwrite=True (--overwrite)")


def check_outside_source(src: Path, dst: Path) -> None:
    """``dst`` may not lie inside the source either: a tool never writes into what it reads
    (checked once the source is known to be a checkpoint, so a wrong ``src`` says so first)."""
    if dst.resolve().is_relative_to(src.resolve()):
        raise ExtractError(
            f"destination {dst} is inside the source {src}; refusing (write it outside {src})"
        )


def _check_replaceable(dst: Path, overwrite: bool) -> None:
    """What ``extract`` may write to: a new path under a writable directory, an empty
    directory, or (``overwrite``) a directory one of our tools wrote — never a regular file or a
    directory someone else filled."""
    if dst.exists() or dst.is_symlink():
        if not dst.is_dir():
            raise DestinationExistsError(
                f"destination {dst} exists and is not a directory; refusing to replace it "
                "(--overwrite only replaces a directory omni-extract wrote)"
            )
        if overwrite and any(dst.iterdir()) and not any((dst / m).is_file() for m in OWN_MARKERS):
            raise DestinationExistsError(
                f"destination {dst} was not written by omni-extract (no {MARKER_FILE}); "
                "refusing to replace it: remove it yourself or choose another --dst"
            )
    parent = dst.parent.absolute()
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ExtractError(f"cannot create {dst}: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ExtractError(f"cannot create {dst}: no permission to write into {parent}")


def _clean_stale_temps(dst: Path) -> None:
    """Remove ``.<dst>.tmp-*`` / ``.old-*`` siblings left by a killed extraction into ``dst``:
    those naming a dead writer pid, or (older names) idle for 15 minutes. One log line."""
    import logging
    import time

    if not dst.parent.is_dir():
        return
    removed, total = [], 0
    for path in dst.parent.glob(f".{glob_escape(dst.name)}.*"):
        found = _TEMP_OF.match(path.name[len(dst.name) + 1 :])
        if found is None or not path.is_dir():
            continue
        pid = found.group("pid")
        if pid is not None:
            stale = not process_alive(int(pid))
        else:
            newest = max([path.stat().st_mtime, *(p.stat().st_mtime for p in path.iterdir())])
            stale = time.time() - newest >= 15 * 60
        if stale:
            total += sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
    if removed:
        logging.getLogger(__name__).warning(
            "removed %d stale temporary dir(s) of interrupted extractions next to %s (%.1f MB): %s",
            len(removed),
            dst,
            total / 1e6,
            ", ".join(removed),
        )


_TEMP_OF = re.compile(r"^\.(?:tmp|old)-(?:p(?P<pid>\d+)-)?.+$")


def glob_escape(name: str) -> str:
    import glob

    return glob.escape(name)


def process_alive(pid: int) -> bool:
    """Whether the writer ``pid`` of a temp dir still runs (this process counts as gone: its temps
    live inside one call, none spans a new run). Shared with omni_grpo's run-dir cleanup."""
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _declared_dtype(source: OmniSource) -> str | None:
    cfg = source.config
    return cfg.get("dtype") or cfg.get("torch_dtype") or source.thinker_config.get("dtype")


def resolve_dtype(plan: ExtractionPlan, source: OmniSource, dtype: DtypeChoice) -> DtypeChoice:
    """``keep`` of a checkpoint whose selected tensors have mixed dtypes would write a mixed
    output under a config declaring one dtype: cast to the declared one (said in one log line),
    or refuse when the config declares none we can write. ``plan`` is the ``keep`` plan."""
    variant = plan.variant
    if dtype != "keep":
        return dtype
    counts: dict[torch.dtype, int] = {}
    for out in plan.outputs:
        for t in [out.source] if out.source is not None else [p for p, _, _ in out.parts]:
            if t is not None:
                counts[t.dtype] = counts.get(t.dtype, 0) + 1
    if len(counts) <= 1:
        return dtype
    mix = ", ".join(
        f"{n} {str(d).removeprefix('torch.')}" for d, n in sorted(counts.items(), key=str)
    )
    declared = _declared_dtype(source)
    choice = {"float32": "fp32", "bfloat16": "bf16"}.get(str(declared))
    if choice is None:
        raise ExtractError(
            f"{source.root}: the {variant} tensors have mixed dtypes ({mix}) and config.json "
            f"declares dtype {declared!r}: pass --dtype bf16 or --dtype fp32 to choose one"
        )
    import logging

    logging.getLogger(__name__).warning(
        "%s: the %s tensors have mixed dtypes (%s); casting all to %s, the dtype config.json "
        "declares (pass --dtype to choose another)",
        source.root,
        variant,
        mix,
        declared,
    )
    return choice  # type: ignore[return-value]


def install_dir(tmp: Path, dst: Path) -> None:
    """Rename the finished temp dir onto ``dst``; an old ``dst`` is moved aside, then deleted."""
    old: Path | None = None
    if dst.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-p{os.getpid()}-", dir=dst.parent))
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
    check_destination(src_path, dst_path, overwrite)
    _check_replaceable(dst_path, overwrite)
    size = parse_size(shard_size)
    source = open_source(src_path)
    check_outside_source(src_path, dst_path)
    plan = build_plan(source, variant, dtype, size)
    resolved = resolve_dtype(plan, source, dtype)
    if resolved != dtype:
        dtype, plan = resolved, build_plan(source, variant, resolved, size)
    cast = None if dtype == "keep" else plan.outputs[0].dtype

    try:
        dst_path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ExtractError(f"cannot create {dst_path}: {exc.strerror or exc}") from exc
    _clean_stale_temps(dst_path)
    needed = plan.total_bytes + (1 << 20)
    free = shutil.disk_usage(dst_path.parent).free
    if free < needed:
        raise ExtractError(_disk_full(dst_path, needed))
    tmp = Path(
        tempfile.mkdtemp(prefix=f".{dst_path.name}.tmp-p{os.getpid()}-", dir=dst_path.parent)
    )
    try:
        if progress is True:
            from omni_extract.progress import rich_progress

            with rich_progress(plan, f"{variant} <- {src_path.name}") as cb:
                shards = stream_weights(source, plan, tmp, cb)
        else:
            shards = stream_weights(source, plan, tmp, progress or None)
        _write_config(source, variant, cast, tmp)
        copy_processor_artifacts(src_path, tmp)
        marker = {"tool": "omni-extract", "variant": variant, "source": str(src_path.absolute())}
        (tmp / MARKER_FILE).write_text(json.dumps({**marker, "dtype": dtype}, indent=2))
        install_dir(tmp, dst_path)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError | RuntimeError) and not isinstance(exc, ExtractError):
            # Name the destination, not the hidden temp dir the error happened in.
            if _is_disk_full(exc):
                raise ExtractError(_disk_full(dst_path, needed)) from exc
            text = str(exc).replace(str(tmp), str(dst_path))
            raise ExtractError(f"writing {dst_path} failed: {text}") from exc
        raise
    return ExtractResult(dst_path, variant, len(plan.outputs), plan.total_bytes, shards)


def _is_disk_full(exc: BaseException) -> bool:
    import errno

    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(exc).lower()
    return any(t in text for t in ("no space left", "storagefull", "iostream error", "errno 28"))


def _disk_full(dst: Path, needed: int) -> str:
    free = shutil.disk_usage(dst.parent).free
    return (
        f"disk full: writing {dst} needs about {needed / 1e9:.3f} GB, "
        f"{dst.parent} has {free / 1e9:.3f} GB free"
    )
