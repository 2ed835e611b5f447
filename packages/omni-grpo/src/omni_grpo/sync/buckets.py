"""Group a stream of tensors into size-bounded buckets, knowing which bucket is the last.

The last bucket carries ``flush_cache`` and the new ``weight_version``; with a generator source (a
Megatron export) "last" is only known once the source is exhausted. A tensor larger than the
bucket goes alone in its own bucket.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from omni_grpo.sync.base import dtype_name


@dataclass
class Bucket:
    names: list[str] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)
    nbytes: int = 0
    last: bool = False

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.names.append(name)
        self.tensors.append(tensor)
        self.nbytes += tensor.numel() * tensor.element_size()

    @property
    def dtypes(self) -> list[str]:
        return [dtype_name(t.dtype) for t in self.tensors]

    @property
    def shapes(self) -> list[list[int]]:
        return [list(t.shape) for t in self.tensors]


def buckets(pairs: Iterable[tuple[str, torch.Tensor]], max_bytes: int) -> Iterator[Bucket]:
    """Yield buckets of at most ``max_bytes`` (or one oversize tensor); the final one has ``last``.

    A full bucket is yielded as soon as the next tensor arrives (which proves it is not the last),
    so at most one bucket plus one tensor is held at a time.
    """
    if max_bytes <= 0:
        raise ValueError(f"bucket size must be positive, got {max_bytes} bytes")
    current = Bucket()
    for name, tensor in pairs:
        size = tensor.numel() * tensor.element_size()
        if current.names and current.nbytes + size > max_bytes:
            yield current
            current = Bucket()
        current.add(name, tensor)
    if current.names:
        current.last = True
        yield current


def dtype_runs(dtypes: Sequence[str]) -> list[tuple[str, list[int]]]:
    """A bucket's tensor indices grouped by dtype, dtypes in first-seen order.

    Between two ends that both run our code (the Ray rollout actors), each group travels as ONE
    flat broadcast instead of one per tensor: a small model has hundreds of tensors, and each
    broadcast is a round trip through the collective (a third of a tiny run's step went there).
    Both ends derive the same groups from the bucket's ``dtypes``.
    """
    runs: dict[str, list[int]] = {}
    for i, dtype in enumerate(dtypes):
        runs.setdefault(dtype, []).append(i)
    return list(runs.items())


def flatten(tensors: Sequence[torch.Tensor], indices: Sequence[int]) -> torch.Tensor:
    """The tensors at ``indices`` (one dtype) as one contiguous 1-D tensor, in that order."""
    return torch.cat([tensors[i].reshape(-1) for i in indices])


def unflatten(flat: torch.Tensor, shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Views of ``flat`` with ``shapes``, in order (the inverse of ``flatten``)."""
    out, offset = [], 0
    for shape in shapes:
        size = math.prod(shape)
        out.append(flat[offset : offset + size].view(*shape))
        offset += size
    if offset != flat.numel():
        raise ValueError(f"flat buffer has {flat.numel()} elements, the shapes {offset}")
    return out
