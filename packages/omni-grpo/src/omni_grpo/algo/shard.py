"""Split one step's ``GRPOBatch`` into data-parallel shards of about equal token count.

The driver calls ``shard_batch(batch, world_size)`` after the advantages are computed and hands
shard ``r`` to trainer rank ``r``; every rank's ``backend.step`` then all-reduces the loss
normalisers and sums the gradients (``omni_grpo.types.TrainerBackend``), so the update equals the
single-process step on the whole batch.

Choices:

* **Groups stay whole, always.** A group is the unit the torch backend micro-batches (rows of one
  prompt share its media and its prompt forward), so whole groups keep every micro-batch — and
  with it every logit — identical to the single-process step; its advantages were computed over
  the whole group before sharding anyway. With fewer groups than ranks the surplus ranks get an
  EMPTY shard (zero groups) and still call ``step``: they contribute nothing and take the same
  update.
* **Balanced by forward tokens**: a group costs ``sum(len(prompt) + len(completion))`` over its
  rows (each row forwards its prompt again), which is what a step's compute and activation memory
  scale with; longest-processing-time greedy (largest group to the least-loaded rank, ties to the
  lower index), within 4/3 of the best split.
* **Deterministic and order-preserving**: the same batch gives the same shards on every call, and
  each shard keeps its groups in batch order.
"""

from __future__ import annotations

import torch

from omni_grpo.types import GRPOBatch


def group_tokens(batch: GRPOBatch) -> list[int]:
    """Forward tokens of each group: prompt + completion, summed over its rows."""
    return [sum(len(c.prompt.input_ids) + len(c.token_ids) for c in g) for g in batch.groups]


def shard_batch(batch: GRPOBatch, world_size: int) -> list[GRPOBatch]:
    """``world_size`` shards of ``batch`` (whole groups, balanced by forward tokens)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if batch.advantages.shape[0] != len(batch.groups):
        raise ValueError(
            f"GRPOBatch has {len(batch.groups)} groups but advantages for "
            f"{batch.advantages.shape[0]}"
        )
    cost = group_tokens(batch)
    load = [0] * world_size
    members: list[list[int]] = [[] for _ in range(world_size)]
    for g in sorted(range(len(cost)), key=lambda g: (-cost[g], g)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        members[rank].append(g)
        load[rank] += cost[g]
    shards = []
    for idx in members:
        idx.sort()
        shards.append(
            GRPOBatch(
                [batch.groups[g] for g in idx],
                batch.advantages[torch.tensor(idx, dtype=torch.long)],
                temperature=batch.temperature,
                lr=batch.lr,
            )
        )
    return shards
