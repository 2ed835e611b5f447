"""The step policy every backend applies around ``grpo_loss``, written once.

A backend's ``step`` reads top to bottom in its own file (micro-batching and the forward are its
business); what it decides and reports goes through these plain functions, so the torch and
Megatron backends cannot drift apart again:

1. **What the loss normaliser counts** (:func:`local_counts`, then :func:`global_counts`):
   ``num_samples`` is every completion of the step, empty ones included (an empty completion is a
   sample that earned its advantage with zero tokens; dropping it from the count would reweight
   the others by how many happened to be empty); ``num_tokens`` the response tokens. Over a
   data-parallel world both are all-reduced, so every rank divides by the global count and the
   rank losses add up to the single-process loss.
2. **Whether to apply the update** (:func:`should_step`): not when the gradient norm is NaN/inf
   (``skip_nonfinite``), and not when no completion with tokens has a non-zero advantage and
   neither a KL nor an entropy term is on (``no_signal``): the policy gradient is exactly zero
   then, and an AdamW step would only replay stale momentum (measured on the torch backend: it
   drove a converged policy from reward 1.0 to 0.5 with no gradient to pull it back).
3. **How micro-batch metrics combine** (:class:`MetricSums`): the loss parts (``loss``,
   ``pg_loss``, ``kl_loss``, ``entropy_loss``) are already divided by the global normaliser, so
   they are SUMMED; every other metric is a mean over one micro-batch's response tokens and is
   averaged WEIGHTED BY TOKENS. Token weighting makes the logged value the mean over all of the
   step's tokens, whatever ``micro_batch_size`` / ``max_tokens_per_gpu`` or the data-parallel
   world size cut the step into (exactly, for the linear means such as ``pg_clipfrac`` and
   ``ppo_kl``); sample weighting would change ``pg_clipfrac`` with the micro-batch split.
   Non-finite values of those means (a Pearson correlation of one token) are left out.
4. **The learning rate** (:func:`apply_lr` sets the step's ``GRPOBatch.lr``, the loop's schedule
   from ``omni_grpo.algo.schedule``; :func:`current_lr` reports it): read back from the optimizer,
   i.e. the value the update used, never from the config.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist

from omni_grpo.algo.loss import read_metrics

if TYPE_CHECKING:
    from omni_grpo.config import AlgoConfig
    from omni_grpo.types import GRPOBatch

StepDecision = Literal["step", "skip_nonfinite", "no_signal"]

# Metrics already normalised by the global sample/token count: micro-batch values add up.
LOSS_PART_KEYS: frozenset[str] = frozenset({"loss", "pg_loss", "kl_loss", "entropy_loss"})


def dp_world_size(group: Any = None) -> int:
    """Size of the data-parallel world: 1 unless ``torch.distributed`` is initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


@dataclass(frozen=True)
class StepCounts:
    """The loss normalisers of one optimizer step and whether any row carries signal."""

    num_samples: float  # completions, empty ones included
    num_tokens: float  # response tokens
    has_signal: bool  # some completion with tokens has a non-zero advantage


def local_counts(batch: GRPOBatch) -> StepCounts:
    """Counts of this process's (shard of the) batch."""
    samples = tokens = 0
    signal = False
    for g, group in enumerate(batch.groups):
        for i, c in enumerate(group):
            samples += 1
            tokens += len(c.token_ids)
            signal = signal or (bool(c.token_ids) and float(batch.advantages[g, i]) != 0.0)
    return StepCounts(float(samples), float(tokens), signal)


def global_counts(
    counts: StepCounts, device: torch.device | str = "cpu", group: Any = None
) -> StepCounts:
    """``counts`` summed over the data-parallel world (one all-reduce; identity in one process).

    ``device`` is where the collective's tensor lives: the CPU for gloo, the rank's GPU for NCCL.
    """
    if dp_world_size(group) == 1:
        return counts
    t = torch.tensor(
        [counts.num_samples, counts.num_tokens, float(counts.has_signal)],
        dtype=torch.float64,
        device=device,
    )
    dist.all_reduce(t, group=group)
    samples, tokens, signal = t.tolist()
    return StepCounts(samples, tokens, signal > 0)


def should_step(grad_norm: float, has_signal: bool, algo: AlgoConfig) -> StepDecision:
    """Apply the optimizer update, skip it for a non-finite norm, or skip it for lack of signal.

    ``has_signal`` must be the GLOBAL flag (``global_counts``) so every rank decides the same.
    """
    if not math.isfinite(grad_norm):
        return "skip_nonfinite"
    if has_signal or algo.kl_coef != 0 or algo.entropy_coef != 0:
        return "step"
    return "no_signal"


@dataclass
class MetricSums:
    """Accumulates ``grpo_loss`` metrics over micro-batches (and epochs, and ranks)."""

    sums: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    weights: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    micro_batches: int = 0

    def add(self, metrics: Mapping[str, float], tokens: float) -> None:
        """One micro-batch's metrics; ``tokens`` its response-token count."""
        self.micro_batches += 1
        for k, v in metrics.items():
            if k in LOSS_PART_KEYS:
                self.sums[k] += v
                self.weights[k] = 1.0
            elif k != "response_tokens" and math.isfinite(v):
                self.sums[k] += v * tokens
                self.weights[k] += tokens

    def merge(self, others: Iterable[MetricSums]) -> MetricSums:
        """The sum of ``self`` and ``others`` (e.g. every rank's accumulator)."""
        out = MetricSums()
        for part in (self, *others):
            out.micro_batches += part.micro_batches
            for k, v in part.sums.items():
                out.sums[k] += v
            for k, w in part.weights.items():
                out.weights[k] = 1.0 if k in LOSS_PART_KEYS else out.weights[k] + w
        return out

    def reduce(self, group: Any = None) -> MetricSums:
        """Every rank's sums merged (collective over the data-parallel world; identity in one
        process). The key sets may differ: a rank with an empty shard has none."""
        world = dp_world_size(group)
        if world == 1:
            return self
        parts: list[Any] = [None] * world
        mine = (dict(self.sums), dict(self.weights), self.micro_batches)
        dist.all_gather_object(parts, mine, group=group)
        gathered = [
            MetricSums(defaultdict(float, s), defaultdict(float, w), n) for s, w, n in parts
        ]
        return gathered[0].merge(gathered[1:])

    def means(self) -> dict[str, float]:
        return {k: self.sums[k] / self.weights[k] for k in self.sums if self.weights[k] > 0}


@dataclass
class DeferredMetrics:
    """:class:`MetricSums` fed ``grpo_loss_terms``' device tensors, read back once at the end.

    Why: reading a micro-batch's metrics makes the host wait for its forward; with the read
    between the forward and ``loss.backward()``, the GPU then idles while the host queues the
    backward, every micro-batch. Queued here, they are read in one transfer by :meth:`resolve`
    and summed in the same order with the same float arithmetic as :meth:`MetricSums.add`."""

    pending: list[tuple[dict[str, torch.Tensor], float]] = field(default_factory=list)

    def add(self, metrics: Mapping[str, torch.Tensor], tokens: float) -> None:
        self.pending.append((dict(metrics), tokens))

    def resolve(self) -> MetricSums:
        sums = MetricSums()
        read = read_metrics(
            {(i, k): v for i, (metrics, _) in enumerate(self.pending) for k, v in metrics.items()}
        )
        for i, (metrics, tokens) in enumerate(self.pending):
            sums.add({k: read[i, k] for k in metrics}, tokens)
        self.pending.clear()
        return sums


def apply_lr(optimizer: torch.optim.Optimizer, lr: float | None) -> None:
    """Set the step's learning rate (``GRPOBatch.lr``, the loop's schedule) on every param group;
    ``None`` leaves the optimizer's own (``trainer.lr``): callers that build batches by hand."""
    if lr is None:
        return
    for group in optimizer.param_groups:
        group["lr"] = lr


def current_lr(optimizer: torch.optim.Optimizer) -> float:
    """The learning rate the update used (first param group)."""
    return float(optimizer.param_groups[0]["lr"])


def step_metrics(
    sums: MetricSums,
    counts: StepCounts,
    grad_norm: float,
    decisions: Iterable[StepDecision],
    lr: float,
) -> dict[str, float]:
    """The metrics dict every backend's ``step`` returns (``sums`` already reduced over ranks)."""
    seen = Counter(decisions)
    out = sums.means()
    out.update(
        grad_norm=float(grad_norm),
        skipped_step=float(seen["skip_nonfinite"]),
        no_signal_step=float(seen["no_signal"]),
        response_tokens=counts.num_tokens,
        lr=float(lr),
        micro_batches=float(sums.micro_batches),
    )
    return out
