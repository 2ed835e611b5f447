"""Gradient reduction and the global grad norm for a megatron-core model without Megatron's DDP.

We drive the model with a plain optimizer (fp32 master weights, :mod:`.optim`), so the gradient
reductions Megatron's ``finalize_model_grads`` would do are done here, by the same rules:

* TP-replicated params whose gradient is a partial sum over TP ranks are SUMMED over the TP group:
  everything tagged ``sequence_parallel`` under SP (norms, router: each rank saw a sequence chunk)
  and the q/k layernorms (each rank saw its own heads).
* Dense params are SUMMED over the data-parallel group, expert params (``allreduce=False``) over
  the expert-data-parallel group — not averaged, because every data-parallel rank's loss is
  already divided by the GLOBAL sample/token count of the step (``omni_grpo.algo.step``), so the
  per-rank gradients are parts of one sum (megatron-core's per-token-loss mode does the same). A
  parameter with a gradient on some ranks only (an expert no local token was routed to) joins
  the sum as zeros there; one that no rank touched keeps ``grad=None``.

The grad norm counts every distinct parameter element exactly once across the world.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from omni_grpo.backends.megatron._mcore import mcore


def _is_expert(p: nn.Parameter) -> bool:
    return getattr(p, "allreduce", True) is False


def _is_tp_sharded(p: nn.Parameter) -> bool:
    return bool(getattr(p, "tensor_model_parallel", False))


def _tp_partial(name: str, p: nn.Parameter, sequence_parallel: bool) -> bool:
    if _is_tp_sharded(p) or _is_expert(p):
        return False
    if "q_layernorm" in name or "k_layernorm" in name:
        return True
    return sequence_parallel and bool(getattr(p, "sequence_parallel", False))


def _reduce(grads: list[torch.Tensor], group: object, op: dist.ReduceOp) -> None:
    if not grads or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=op, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def _sum_over(params: list[nn.Parameter], group: object) -> None:
    """Sum ``params``' gradients over ``group``; ``None`` joins as zeros and stays ``None`` only
    when it is ``None`` on every rank (so every rank reduces the same flat buffer)."""
    if not params or dist.get_world_size(group) == 1:
        return
    present = torch.tensor(
        [p.grad is not None for p in params], dtype=torch.float32, device=params[0].device
    )
    dist.all_reduce(present, group=group)
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    _reduce(grads, group, dist.ReduceOp.SUM)
    for p, g, n in zip(params, grads, present.tolist(), strict=True):
        p.grad = g if n > 0 else None


def finalize_grads(model: nn.Module, sequence_parallel: bool) -> None:
    """Make every rank's ``.grad`` the full gradient of its shard, summed over data parallelism."""
    ps = mcore().parallel_state
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad and p.grad is not None]
    _reduce(
        [p.grad for n, p in named if _tp_partial(n, p, sequence_parallel)],
        ps.get_tensor_model_parallel_group(),
        dist.ReduceOp.SUM,
    )
    trainable = [p for p in model.parameters() if p.requires_grad]
    _sum_over([p for p in trainable if not _is_expert(p)], ps.get_data_parallel_group())
    _sum_over([p for p in trainable if _is_expert(p)], ps.get_expert_data_parallel_group())


def global_grad_norm(model: nn.Module) -> torch.Tensor:
    """L2 norm of the full model gradient (after :func:`finalize_grads`), identical on every rank."""
    ps = mcore().parallel_state
    tp_rank = ps.get_tensor_model_parallel_rank()
    dp = dist.get_world_size(ps.get_data_parallel_group())
    edp = dist.get_world_size(ps.get_expert_data_parallel_group())
    sq = None
    for _, p in model.named_parameters():
        if p.grad is None:
            continue
        g = p.grad.float().pow(2).sum()
        if _is_expert(p):
            g = g / edp
        elif _is_tp_sharded(p) or tp_rank == 0:
            g = g / dp
        else:
            continue
        sq = g if sq is None else sq + g
    device = next(model.parameters()).device
    sq = sq if sq is not None else torch.zeros((), device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(sq)
    return sq.sqrt()
