"""Group-normalised GRPO advantages (one scalar per completion, broadcast over its tokens)."""

from __future__ import annotations

import torch


def group_advantages(
    rewards: torch.Tensor, group_size: int, *, std_normalize: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """``A_i = (r_i - mean_g(r)) / (std_g(r) + eps)`` over each group of ``group_size`` samples.

    ``rewards`` is flat ``[num_groups * group_size]`` with each prompt's samples contiguous (the order
    rollout engines return them), or already ``[num_groups, group_size]``; the output has the same
    shape. ``std`` is the unbiased (N-1) estimate, as in GRPO/GSPO. ``std_normalize=False`` is the
    Dr.GRPO variant (mean-centring only). With ``group_size == 1`` there is no group statistic: the
    std division is skipped (it would be NaN) and the centred advantage is 0 — such a step carries no
    policy-gradient signal, which is the honest answer for GRPO without a baseline.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    shape = rewards.shape
    r = rewards.to(torch.float32)
    if r.dim() == 1:
        if r.numel() % group_size:
            raise ValueError(f"{r.numel()} rewards do not split into groups of {group_size}")
        r = r.view(-1, group_size)
    elif r.dim() != 2 or r.shape[1] != group_size:
        raise ValueError(f"rewards must be [N] or [G, {group_size}], got {tuple(shape)}")
    centred = r - r.mean(dim=1, keepdim=True)
    if std_normalize and group_size > 1:
        centred = centred / (r.std(dim=1, unbiased=True, keepdim=True) + eps)
    return centred.reshape(shape)
