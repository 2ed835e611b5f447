"""Token logprobs and entropy of vocab-sharded logits (``[..., V/tp]``), over the TP group.

Both also run at tp = 1, where they equal ``omni_grpo.algo.token_logprobs_from_logits`` /
``entropy_from_logits`` on the whole vocabulary.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from omni_grpo.backends.megatron._mcore import mcore


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``log softmax(logits)[target]`` for vocab-sharded logits ``[B, S, V/tp]`` (float32).

    megatron's vocab-parallel cross entropy, also at tp = 1: on an H200 it beat the shared chunked
    ``omni_grpo.algo.token_logprobs_from_logits`` (which recomputes each chunk in backward) by
    7 % of the whole benchmark step (115.7 vs 124.2 ms, benchmarks/megatron_step.py --loss).
    """
    x = logits.float()
    if x is logits:  # megatron's cross entropy works in place on its input
        x = x.clone()
    return -mcore().vocab_parallel_cross_entropy(x, targets)


def vocab_parallel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy (nats, float32) of ``softmax(logits)`` for vocab-sharded ``[..., V/tp]`` logits.

    ``H = log Z + m - sum(p * z)`` with the max, the partition sum and ``sum(p * z)`` reduced over the
    TP group; the reductions are megatron's all-reduce-forward / identity-backward region, so the
    gradient of each shard is its exact share.
    """
    m = mcore()
    z = logits.float()
    zmax = z.detach().amax(-1, keepdim=True)
    tp = m.parallel_state.get_tensor_model_parallel_world_size()
    if tp > 1:
        dist.all_reduce(
            zmax, op=dist.ReduceOp.MAX, group=m.parallel_state.get_tensor_model_parallel_group()
        )
    e = torch.exp(z - zmax)
    sum_e = e.sum(-1, keepdim=True)
    sum_ez = (e * z).sum(-1, keepdim=True)
    if tp > 1:
        sum_e = m.reduce_from_tensor_model_parallel_region(sum_e)
        sum_ez = m.reduce_from_tensor_model_parallel_region(sum_ez)
    return (torch.log(sum_e) + zmax - sum_ez / sum_e).squeeze(-1)
