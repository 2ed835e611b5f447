"""A streaming safetensors shard writer.

``safetensors.torch.save_file`` needs every tensor of a shard in memory and then serialises a
second copy, i.e. 2x a shard of RSS. Because the extraction plan knows every output tensor's name,
dtype and shape before reading any data, we write the (standard) safetensors header first and then
append each tensor's bytes as they are produced — whole tensors, pieces (one fused expert at a
time), or a kernel-side ``sendfile`` straight from the input shard for tensors that pass through
unchanged. The files are plain safetensors (8-byte little-endian header length, JSON header with
``__metadata__ = {"format": "pt"}``, contiguous data) and are read back with ``safe_open`` in tests.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from omni_extract.source import TORCH_TO_ST, tensor_nbytes


@dataclass(frozen=True)
class PlannedTensor:
    """One output tensor as the header announces it."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.dtype, self.shape)


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


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous tensor, without a copy."""
    return memoryview(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def write_all(fd: int, data: memoryview) -> None:
    while data:
        n = os.write(fd, data)
        data = data[n:]


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


class ShardWriter:
    """Write one shard whose tensors arrive in the announced order, each checked for size."""

    def __init__(self, path: Path, tensors: list[PlannedTensor], metadata: dict[str, str]) -> None:
        self.path = path
        self._pending = list(reversed(tensors))
        self._current: PlannedTensor | None = None
        self._remaining = 0
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        write_all(self._fd, memoryview(_header(tensors, metadata)))

    def begin(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        """Start the next announced tensor; its bytes follow through ``append``/``copy_from``."""
        if self._current is not None:
            raise RuntimeError(f"{self.path}: {self._current.name} not finished")
        if not self._pending:
            raise RuntimeError(f"{self.path}: unexpected extra tensor {name!r}")
        want = self._pending.pop()
        if name != want.name or dtype != want.dtype or tuple(shape) != want.shape:
            raise RuntimeError(
                f"{self.path}: expected {want.name} {want.dtype} {want.shape}, "
                f"got {name} {dtype} {tuple(shape)}"
            )
        self._current, self._remaining = want, want.nbytes

    def append(self, data: memoryview) -> None:
        self._take(len(data))
        write_all(self._fd, data)

    def copy_from(self, src_fd: int, offset: int, nbytes: int) -> None:
        """Copy ``nbytes`` at ``offset`` of another file in the kernel (no user-space copy)."""
        self._take(nbytes)
        while nbytes:
            try:
                sent = os.sendfile(self._fd, src_fd, offset, nbytes)
            except OSError:  # filesystems without sendfile between files: plain read/write
                sent = len(chunk := os.pread(src_fd, min(nbytes, 1 << 26), offset))
                write_all(self._fd, memoryview(chunk))
            if sent == 0:
                raise OSError(f"{self.path}: source ended {nbytes} bytes early at offset {offset}")
            offset += sent
            nbytes -= sent

    def reserve(self) -> tuple[int, int]:
        """Claim the rest of the current tensor for positional writes: ``(fd, absolute offset)``.

        Worker threads then fill the region (through a ``MappedRegion`` or ``pwrite_all``) in any
        order, in parallel; the file position moves past it so later tensors append as usual.
        """
        if self._current is None:
            raise RuntimeError(f"{self.path}: reserve() outside a tensor")
        start = os.lseek(self._fd, 0, os.SEEK_CUR)
        os.lseek(self._fd, self._remaining, os.SEEK_CUR)
        self._remaining = 0
        return self._fd, start

    def end(self) -> int:
        """Finish the current tensor (all its bytes must have arrived); return its size."""
        cur = self._current
        if cur is None or self._remaining:
            raise RuntimeError(f"{self.path}: {cur and cur.name} is {self._remaining} bytes short")
        self._current = None
        return cur.nbytes

    def write(self, name: str, tensor: torch.Tensor) -> int:
        """Write a whole tensor (the next announced one, same dtype and shape)."""
        self.begin(name, tensor.dtype, tuple(tensor.shape))
        if tensor.numel():
            self.append(tensor_bytes(tensor))
        return self.end()

    def _take(self, n: int) -> None:
        if self._current is None or n > self._remaining:
            raise RuntimeError(f"{self.path}: {n} bytes more than announced for {self._current}")
        self._remaining -= n

    def close(self) -> None:
        if self._pending or self._current is not None:
            os.close(self._fd)
            raise RuntimeError(f"{self.path}: announced tensors never written")
        os.close(self._fd)

    def abort(self) -> None:
        os.close(self._fd)


class MappedRegion:
    """A writable shared map of ``[start, start + nbytes)`` of an open file, for parallel fills.

    Why not ``pwrite``: buffered writes to one ext4 file take the inode lock exclusively, so
    worker threads writing their expert blocks serialise and spin on it, and every byte is copied
    twice (into a buffer, then into the page cache). Through a shared map the transpose writes
    straight into the page-cache pages, and page faults on different pages run in parallel.
    The blocks are allocated up front (``posix_fallocate``) so a full disk is an ``OSError`` here,
    not a SIGBUS on a later page fault. Dirty pages dropped from the map (``release``) stay in the
    page cache and are written back as usual; nothing is lost when the map is closed.
    """

    def __init__(self, fd: int, start: int, nbytes: int) -> None:
        os.posix_fallocate(fd, start, nbytes)
        self._skew = start % mmap.ALLOCATIONGRANULARITY
        self._map = mmap.mmap(fd, self._skew + nbytes, offset=start - self._skew)

    def array(self, offset: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """A writable array over the region's bytes at ``offset`` (relative to ``start``)."""
        count = 1
        for d in shape:
            count *= d
        return np.frombuffer(self._map, dtype, count, self._skew + offset).reshape(shape)

    def release(self, offset: int, nbytes: int) -> None:
        """Unmap the whole pages inside ``[offset, offset + nbytes)`` (data stays in the cache).

        Only whole pages: a page shared with a neighbouring block may still be in use."""
        first = self._skew + offset
        lo = -(-first // mmap.PAGESIZE) * mmap.PAGESIZE
        hi = (first + nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if hi > lo:
            self._map.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def close(self) -> None:
        # An array from a failed worker may still be alive; the GC unmaps it then.
        with contextlib.suppress(BufferError):
            self._map.close()
