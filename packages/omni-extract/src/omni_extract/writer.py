"""A streaming safetensors shard writer.

``safetensors.torch.save_file`` needs every tensor of a shard in memory and then serialises a
second copy, i.e. 2x a shard of RSS. Because the extraction plan knows every output tensor's name,
dtype and shape before reading any data, we can write the (standard) safetensors header first and
then append each tensor's bytes as soon as it exists: one tensor in memory instead of two shards.
The files are plain safetensors (8-byte little-endian header length, JSON header with
``__metadata__ = {"format": "pt"}``, contiguous data) and are read back with ``safe_open`` in tests.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from omni_extract.source import TORCH_TO_ST


@dataclass(frozen=True)
class PlannedTensor:
    """One output tensor as the header announces it."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


def _header(tensors: list[PlannedTensor], metadata: dict[str, str]) -> bytes:
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for t in tensors:
        header[t.name] = {
            "dtype": TORCH_TO_ST[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data section 8-byte aligned, as the reference writer does
    return len(raw).to_bytes(8, "little") + raw


class ShardWriter:
    """Write one shard whose tensors arrive one at a time, in the announced order."""

    def __init__(self, path: Path, tensors: list[PlannedTensor], metadata: dict[str, str]) -> None:
        self.path = path
        self._pending = list(reversed(tensors))
        self._fh: BinaryIO = open(path, "wb")  # noqa: SIM115 - closed in close()
        self._fh.write(_header(tensors, metadata))

    def write(self, name: str, tensor: torch.Tensor) -> int:
        """Append ``tensor`` (must be the next announced one, same dtype and shape); return bytes."""
        if not self._pending:
            raise RuntimeError(f"{self.path}: unexpected extra tensor {name!r}")
        want = self._pending.pop()
        if name != want.name or tensor.dtype != want.dtype or tuple(tensor.shape) != want.shape:
            raise RuntimeError(
                f"{self.path}: expected {want.name} {want.dtype} {want.shape}, "
                f"got {name} {tensor.dtype} {tuple(tensor.shape)}"
            )
        if want.nbytes:
            data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
            self._fh.write(memoryview(data))
        return want.nbytes

    def close(self) -> None:
        if self._pending:
            self._fh.close()
            raise RuntimeError(f"{self.path}: {len(self._pending)} announced tensors never written")
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()

    def abort(self) -> None:
        self._fh.close()
