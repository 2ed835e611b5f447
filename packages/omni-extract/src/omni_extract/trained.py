"""Reading trained thinker weights (pseudo-VL names) piece by piece, for writing them back.

A trainer checkpoint holds the trained tensors under the pseudo-Qwen3-VL-MoE names (``vl`` column
of :data:`omni_extract.names.NAME_TABLE`), in one file or in several (per-rank shards). Writing
them back into the hub layout needs them in small pieces: one expert's matrix at a time, one
plain tensor at a time. :class:`TrainedWeights` is that interface; :class:`SafetensorsTrained`
implements it over a list of safetensors files straight from their headers.

Why byte ranges (``FileRange``) and not tensors: in transformers' in-memory fused layout
(``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) every per-expert hub matrix (gate ``[I, H]``,
up ``[I, H]``, down ``[H, I]``) is one contiguous run of bytes in the checkpoint file, so the writer
copies it with ``sendfile`` like any untouched tensor: no read into Python, no transpose. Only the
Qwen3-VL hub layout (``[E, H, 2I]`` / ``[E, I, H]``) needs a transpose, done per expert.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import torch

from omni_extract.errors import CorruptShardError, TensorMismatchError
from omni_extract.kernels import pread_into
from omni_extract.names import ExpertPart, match
from omni_extract.source import ST_TO_TORCH, tensor_nbytes

# How fused experts are laid out in a trained file (the square-shape trap makes it undetectable
# from shapes alone, so the caller must say): transformers' in-memory layout, or Qwen3-VL's hub.
FusedLayout = Literal["hf_memory", "vl_hub"]
FUSED_LAYOUTS: tuple[FusedLayout, ...] = ("hf_memory", "vl_hub")


@dataclass(frozen=True)
class FileRange:
    """``nbytes`` contiguous bytes at ``offset`` of ``path``: a tensor of ``dtype`` and ``shape``."""

    path: Path
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.dtype, self.shape)

    def read(self) -> torch.Tensor:
        fd = os.open(self.path, os.O_RDONLY)
        try:
            return pread_into(fd, torch.empty(self.shape, dtype=self.dtype), self.offset)
        finally:
            os.close(fd)


Piece = torch.Tensor | FileRange


def piece_tensor(piece: Piece) -> torch.Tensor:
    return piece.read() if isinstance(piece, FileRange) else piece


class TrainedWeights(Protocol):
    """Trained tensors under pseudo-VL names, readable in hub-sized pieces.

    ``shapes`` gives every tensor's shape with fused experts in the Qwen3-VL hub layout
    (``[E, H, 2I]`` / ``[E, I, H]``), whatever the storage layout, so callers compare shapes
    against the base checkpoint without knowing how the trainer stored them.
    """

    def names(self) -> list[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def dtype(self, name: str) -> torch.dtype: ...

    def tensor(self, name: str) -> Piece:
        """A non-expert tensor, whole."""
        ...

    def hub_expert(self, name: str, expert: int, part: ExpertPart) -> Piece:
        """Expert ``expert``'s hub matrix (gate/up ``[I, H]``, down ``[H, I]``) of fused ``name``."""
        ...

    def vl_block(self, name: str, expert: int) -> Piece:
        """Expert ``expert``'s block of fused ``name`` in the VL hub layout (``[H, 2I]`` / ``[I, H]``)."""
        ...


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a safetensors file, from its header."""

    name: str
    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute offset of the data in ``path``

    def range(self, index: int | None = None) -> FileRange:
        """The whole tensor, or its ``index``-th slice along dim 0 (contiguous by construction)."""
        if index is None:
            return FileRange(self.path, self.offset, self.dtype, self.shape)
        if not 0 <= index < self.shape[0]:
            raise IndexError(f"{self.name}: index {index} outside dim 0 of {list(self.shape)}")
        sub = self.shape[1:]
        step = math.prod(sub) * self.dtype.itemsize
        return FileRange(self.path, self.offset + index * step, self.dtype, sub)


class SafetensorsFiles:
    """Every tensor of a list of safetensors files, from the headers alone (no data read).

    Refuses a name stored in two files (per-rank shards of a replicated tensor would silently
    pick one) and a file shorter than its header claims (a truncated save).
    """

    def __init__(self, files: Sequence[str | os.PathLike[str]]) -> None:
        if not files:
            raise CorruptShardError("no safetensors files given")
        self.files = tuple(Path(f) for f in files)
        self.tensors: dict[str, StoredTensor] = {}
        for path in self.files:
            for t in _read_header(path):
                if t.name in self.tensors:
                    raise TensorMismatchError(
                        f"tensor {t.name!r} is stored in both {self.tensors[t.name].path} and "
                        f"{path}"
                    )
                self.tensors[t.name] = t

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __getitem__(self, name: str) -> StoredTensor:
        return self.tensors[name]

    def read(self, name: str) -> torch.Tensor:
        return self.tensors[name].range().read()


def _read_header(path: Path) -> list[StoredTensor]:
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            header_len = int.from_bytes(fh.read(8), "little")
            if header_len <= 0 or 8 + header_len > size:
                raise ValueError(f"header length {header_len} does not fit a {size}-byte file")
            header = json.loads(fh.read(header_len))
    except (OSError, ValueError) as exc:
        raise CorruptShardError(f"{path}: not a readable safetensors file ({exc})") from exc
    base = 8 + header_len
    out = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        tag = info.get("dtype")
        if tag not in ST_TO_TORCH:
            raise TensorMismatchError(f"{path}: tensor {name!r} has dtype {tag}, expected a float")
        begin, end = info["data_offsets"]
        t = StoredTensor(name, path, ST_TO_TORCH[tag], tuple(info["shape"]), base + begin)
        if base + end > size or end - begin != t.range().nbytes:
            raise CorruptShardError(
                f"{path}: tensor {name!r} needs bytes up to {base + end}, the file has {size} "
                "(truncated?)"
            )
        out.append(t)
    return out


def is_fused(name: str) -> bool:
    found = match(name, "vl")
    return found is not None and found.row.fused is not None


class SafetensorsTrained:
    """:class:`TrainedWeights` over safetensors files holding pseudo-VL names.

    ``layout`` says how the fused experts are stored: ``"hf_memory"`` for a transformers model's
    ``state_dict()`` (the torch backend's checkpoints), ``"vl_hub"`` for files in the Qwen3-VL
    hub layout (omni-extract's ``vl`` output, weight-sync directories).
    """

    def __init__(
        self, files: Sequence[str | os.PathLike[str]] | SafetensorsFiles, layout: FusedLayout
    ) -> None:
        if layout not in FUSED_LAYOUTS:
            raise ValueError(f"layout must be one of {FUSED_LAYOUTS}, got {layout!r}")
        self.store = files if isinstance(files, SafetensorsFiles) else SafetensorsFiles(files)
        self.layout = layout
        self._last_key: tuple[str, int] | None = None
        self._last_block: torch.Tensor | None = None
        for name, t in self.store.tensors.items():
            if is_fused(name) and len(t.shape) != 3:
                raise TensorMismatchError(
                    f"{t.path}: fused expert tensor {name!r} must be 3-D, got {list(t.shape)}"
                )

    def names(self) -> list[str]:
        return list(self.store.tensors)

    def dtype(self, name: str) -> torch.dtype:
        return self.store[name].dtype

    def shape(self, name: str) -> tuple[int, ...]:
        shape = self.store[name].shape
        if self.layout == "hf_memory" and is_fused(name):
            return (shape[0], shape[2], shape[1])
        return shape

    def tensor(self, name: str) -> Piece:
        return self.store[name].range()

    def hub_expert(self, name: str, expert: int, part: ExpertPart) -> Piece:
        block = self.store[name].range(expert)
        if self.layout == "hf_memory":
            # gate_up [2I, H]: gate rows, then up rows; down [H, I] is already the hub matrix
            return expert_row_half(block, part)
        return hub_from_vl_block(self._read_block(name, expert, block), part)

    def _read_block(self, name: str, expert: int, block: FileRange) -> torch.Tensor:
        # gate and up of one expert come from the same VL block: read it once
        if self._last_key != (name, expert):
            self._last_key, self._last_block = (name, expert), block.read()
        assert self._last_block is not None
        return self._last_block

    def vl_block(self, name: str, expert: int) -> Piece:
        block = self.store[name].range(expert)
        if self.layout == "vl_hub":
            return block
        return block.read().T.contiguous()


def expert_row_half(block: FileRange, part: ExpertPart) -> FileRange:
    """gate/up: the first/second half of the rows of a ``[2I, H]`` block; down: the block."""
    if part == "down":
        return block
    rows, cols = block.shape
    half = rows // 2
    offset = block.offset + (half * cols * block.dtype.itemsize if part == "up" else 0)
    return FileRange(block.path, offset, block.dtype, (half, cols))


def hub_from_vl_block(block: torch.Tensor, part: ExpertPart) -> torch.Tensor:
    """One expert's hub matrix from its VL hub block (gate_up ``[H, 2I]`` or down ``[I, H]``)."""
    if part == "down":
        return block.T.contiguous()
    half = block.shape[1] // 2
    cols = slice(0, half) if part == "gate" else slice(half, None)
    return block[:, cols].T.contiguous()


def trained_files(paths: Iterable[str | os.PathLike[str]]) -> list[Path]:
    """Sorted, de-duplicated safetensors paths (for per-rank shard lists)."""
    return sorted({Path(p) for p in paths})


class NoTrained:
    """No trained tensors: exporting it reproduces the base (the untrained policy)."""

    def names(self) -> list[str]:
        return []

    def shape(self, name: str) -> tuple[int, ...]:
        raise KeyError(name)

    def dtype(self, name: str) -> torch.dtype:
        raise KeyError(name)

    def tensor(self, name: str) -> Piece:
        raise KeyError(name)

    def hub_expert(self, name: str, expert: int, part: ExpertPart) -> Piece:
        raise KeyError(name)

    def vl_block(self, name: str, expert: int) -> Piece:
        raise KeyError(name)
