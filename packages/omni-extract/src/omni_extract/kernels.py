"""The two byte-moving primitives of the stream: positional reads and a cache-friendly transpose.

Why not ``tensor.T.contiguous()``: torch's strided copy of a 2-byte dtype walks one side of the
matrix column by column; for the [768, 2048] expert matrices of the real model that ran several
times slower than a memcpy. Copying in row bands of ``TRANSPOSE_BAND`` source rows keeps both
the source band and the destination columns in cache. Bits are moved as same-width integers, so
bf16 needs no numpy float type and the values are bit-exact.
"""

from __future__ import annotations

import os

import numpy as np
import torch

TRANSPOSE_BAND = 64
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


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


def transpose_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[:] = src.T`` (dst may be a column slice of a larger row-major block), bit-exact."""
    if dst.dtype != src.dtype:
        src = src.to(dst.dtype)
    d, s = _bits(dst), _bits(src)
    for i in range(0, s.shape[0], TRANSPOSE_BAND):
        np.copyto(d[:, i : i + TRANSPOSE_BAND], s[i : i + TRANSPOSE_BAND].T)
