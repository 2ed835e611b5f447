"""AdamW on fp32 master copies of (possibly bf16) model shards.

RL learning rates are ~1e-6: an update of 1e-6 relative size vanishes when applied to a bf16
weight (8 mantissa bits), so the optimizer keeps fp32 masters, steps those, and copies them back.
Each rank owns its shards only (no distributed optimizer state sharding), which is what fits a
truncated or tiny thinker; Megatron's distributed optimizer needs its DDP wrapper (CUDA only).
"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

log = logging.getLogger(__name__)


class MasterAdamW:
    def __init__(
        self,
        params: list[nn.Parameter],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        eps: float = 1e-8,
    ) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.masters = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.opt = torch.optim.AdamW(
            self.masters, lr=lr, betas=betas, weight_decay=weight_decay, eps=eps
        )

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def _follow_params(self) -> None:
        """Keep each master (and its AdamW state) on its parameter's device.

        A parameter can change device after the optimizer was built (a model moved to the GPU after
        construction, or a weight swapped in through ``.data``); the master must follow, or the
        gradient hand-off fails with a device mismatch.
        """
        for i, (p, m) in enumerate(zip(self.params, self.masters, strict=True)):
            if m.device == p.device:
                continue
            log.warning("fp32 master %d follows its parameter from %s to %s", i, m.device, p.device)
            m.data = m.data.to(p.device)
            for key, value in self.opt.state.get(m, {}).items():
                if torch.is_tensor(value) and value.dim() > 0:
                    self.opt.state[m][key] = value.to(p.device)

    def step(self, grad_scale: float = 1.0) -> bool:
        """Apply one update with grads multiplied by ``grad_scale``; False (skipped) if non-finite."""
        if not math.isfinite(grad_scale):
            return False
        self._follow_params()
        for p, m in zip(self.params, self.masters, strict=True):
            m.grad = None if p.grad is None else p.grad.float() * grad_scale
        self.opt.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters, strict=True):
                p.copy_(m.to(p.dtype))
        return True
