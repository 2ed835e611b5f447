"""Dynamic micro-batching by ``max_tokens_per_gpu`` and padded ``[3, B, S]`` position ids.

Without transformer-engine there is no THD packing, so a micro-batch is a right-padded ``bshd``
block: samples are grouped first-fit-decreasing so that ``rows * longest <= max_tokens`` (the
padded token count, which is what costs memory), and the sequence length is padded to a multiple
of ``pad_multiple`` (the TP size under sequence parallelism).
"""

from __future__ import annotations

from collections.abc import Sequence


def plan_micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Indices of samples per micro-batch; every sample appears exactly once.

    A sample longer than ``max_tokens`` raises (it could never fit; truncating would drop tokens).
    """
    for i, n in enumerate(lengths):
        if n > max_tokens:
            raise ValueError(
                f"sample {i} has {n} tokens > trainer.megatron.max_tokens_per_gpu={max_tokens}"
            )
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    longest: list[int] = []
    for i in order:
        n = lengths[i]
        for b, members in enumerate(bins):
            if (len(members) + 1) * max(longest[b], n) <= max_tokens:
                members.append(i)
                longest[b] = max(longest[b], n)
                break
        else:
            bins.append([i])
            longest.append(n)
    return [sorted(b) for b in bins]


def padded_length(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
