"""The byte-moving primitives of the stream: positional reads and a fast, bit-exact transpose.

Why not ``tensor.T.contiguous()``: a strided copy of a 2-byte dtype walks one side of the matrix
element by element; on the [768, 2048] bf16 expert matrices of the real model it ran ~10x slower
than a memcpy. ``transpose_into`` instead (1) transposes WIDE words — the source viewed as 8-byte
integers, i.e. 4 bf16 columns at a time, in row bands that stay in cache — and then (2) splits
each word back into its columns, which is a cache-friendly gather with a small stride. Bits are
moved as integers, so bf16 needs no numpy float type and values are bit-exact.

Scratch buffers are reused per thread (``scratch``): a fresh multi-megabyte allocation per expert
matrix costs a page fault per 4 KiB and was measured to slow the transpose down several times.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import torch

TRANSPOSE_BAND = 64
WORD_BYTES = 8
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_local = threading.local()


def scratch(tag: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A per-thread reusable buffer (contents undefined), one per ``(tag, shape, dtype)``."""
    cache: dict[tuple[str, tuple[int, ...], torch.dtype], torch.Tensor]
    cache = _local.__dict__.setdefault("buffers", {})
    key = (tag, tuple(shape), dtype)
    buf = cache.get(key)
    if buf is None:
        if len(cache) > 16:  # shapes change per model part; keep the cache small
            cache.clear()
        buf = cache[key] = torch.empty(shape, dtype=dtype)
    return buf


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.view(_BITS[t.element_size()]).numpy()


def pread_into(fd: int, tensor: torch.Tensor, offset: int) -> torch.Tensor:
    """Fill a contiguous CPU ``tensor`` with the bytes at ``offset`` of ``fd``; return it."""
    view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
    while view:
        n = os.preadv(fd, [view], offset)
        if n == 0:
            raise OSError(f"unexpected end of file at offset {offset} ({len(view)} bytes missing)")
        view, offset = view[n:], offset + n
    return tensor


def _banded_transpose(d: np.ndarray, s: np.ndarray) -> None:
    for i in range(0, s.shape[0], TRANSPOSE_BAND):
        np.copyto(d[:, i : i + TRANSPOSE_BAND], s[i : i + TRANSPOSE_BAND].T)


def transpose_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[:] = src.T`` for a 2-D contiguous ``src`` [R, C]; ``dst`` [C, R] may be a column slice
    of a larger row-major block (only its row stride may differ). Bit-exact; converts dtype first."""
    if dst.dtype != src.dtype:
        src = src.to(dst.dtype)
    transpose_bits_into(_bits(dst), _bits(src.contiguous()))


def transpose_bits_into(d: np.ndarray, s: np.ndarray) -> None:
    """``d[:] = s.T`` on integer views of equal item size. ``s`` may be a read-only array over
    memory-mapped file pages: it is only read, so the source needs no copy into a buffer first."""
    rows, cols = s.shape
    k = WORD_BYTES // s.itemsize  # columns per wide word
    if k <= 1 or cols % k or d.strides[1] != s.itemsize or not s.flags.c_contiguous:
        _banded_transpose(d, s)
        return
    words = scratch("words", (cols // k, rows), torch.int64).numpy()
    _banded_transpose(words, s.view(np.int64))  # [C/k, R] words; word (j, r) = s[r, j*k : j*k+k]
    split = words.view(s.dtype).reshape(cols // k, rows, k)
    out = np.lib.stride_tricks.as_strided(
        d, shape=(cols // k, k, rows), strides=(d.strides[0] * k, d.strides[0], d.strides[1])
    )
    np.copyto(out, split.transpose(0, 2, 1))
