"""The torch backend: one GRPO update of ``load_thinker(...)`` on CPU or GPUs, data-parallel when
``torch.distributed`` is initialised with more than one rank.

``step(batch)`` reads top to bottom: split the step's completions into micro-batches (rows of one
prompt, at most ``micro_batch_size`` each, so no prompt padding and the multimodal positions are
those of an unbatched forward; or, with ``trainer.micro_batch_tokens``, rows of several prompts
packed up to that many padded tokens), forward prompt+completion, take the logprobs of the sampled tokens,
compute the shared GRPO loss (``omni_grpo.algo.grpo_loss_terms``) with global normalisers so that the
micro-batch losses add up to the full-batch loss, backward, and after the last micro-batch clip
the gradient norm and step AdamW — unless ``omni_grpo.algo.step.should_step`` says not to: a
NaN/inf norm skips the step (gradients dropped, weights untouched, ``skipped_step``), and so does a
step where no completion carries an advantage (all 0, no KL/entropy term: ``no_signal_step``), so
AdamW's momentum cannot move the policy. The normaliser counts, metric averaging and the
reported ``lr`` come from ``omni_grpo.algo.step`` too, shared with the Megatron backend.

Old (behaviour) logprobs are the trainer's own recompute: with ``ppo_epochs == 1`` every
micro-batch runs before the single optimizer step, so the detached logprobs of the training
forward ARE the recompute under the rollout weights (bit-identical, no second forward); with more
epochs a no-grad pass computes them first. They are compared to the engine's logprobs for the
mismatch metrics and, with ``algo.tis.enabled``, importance-weighted against them. A frozen
reference copy exists only when ``algo.kl_coef != 0``, and never with LoRA (the live module with
its adapters disabled or swapped is the reference).

Data parallelism (``torch.distributed`` initialised before the backend is built, world > 1; gloo
on CPU, NCCL on GPU): every rank holds the whole model and steps on its shard of the batch
(``omni_grpo.algo.shard.shard_batch``). The initial weights are broadcast from rank 0; the loss
normalisers and the signal flag are all-reduced before the first forward
(``omni_grpo.algo.step.global_counts``); after the last micro-batch the gradients are SUMMED over
the ranks in flat buckets, then clipped and applied identically everywhere, and the metrics are
merged across ranks — so loss, grad norm and updated weights equal the single-process step on the
whole batch (fp32: within 1e-5). The gradients are reduced once per step after local
accumulation, as the Megatron backend's ``finalize_grads`` does, rather than through
``DistributedDataParallel``'s backward hooks: ranks legitimately run different numbers of
micro-batches (zero for an empty shard), and media-tower parameters may be unused on one rank and
used on another — both are what DDP's reducer cannot take without a dummy forward, and a
parameter no rank touched must keep ``grad=None`` (AdamW then leaves it alone, as in one process).
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from omni_grpo.algo import (
    entropy_from_logits,
    forward_kl_from_logits,
    grpo_loss_terms,
    token_logprobs_from_logits,
)
from omni_grpo.algo.step import (
    DeferredMetrics,
    StepDecision,
    apply_lr,
    current_lr,
    dp_world_size,
    global_counts,
    local_counts,
    should_step,
    step_metrics,
)
from omni_grpo.data.collate import collate_mm, repeat_mm
from omni_grpo.types import Completion, GRPOBatch, NamedTensors, PromptInputs, SourceLayout

if TYPE_CHECKING:
    from omni_grpo.config import AlgoConfig, TrainerConfig


@dataclass
class MicroBatch:
    """Rows of one prompt, or packed rows of several: left-padded prompts + right-padded
    completions, so every row's completion starts at column ``prompt_len``."""

    prompts: list[PromptInputs]  # one per row
    input_ids: torch.Tensor  # [B, W + T]
    attention_mask: torch.Tensor  # [B, W + T]: 0 on the prompts' left padding
    mask: torch.Tensor  # [B, T] response tokens
    rollout_logp: torch.Tensor  # [B, T]
    advantages: torch.Tensor  # [B]
    prompt_len: int  # W
    mm: dict[str, torch.Tensor]  # the rows' media, in row order
    position_ids: torch.Tensor | None = None  # [3, B, W + T], host; set by the step's first forward

    @property
    def prompt(self) -> PromptInputs:
        return self.prompts[0]


# Gradient all-reduce buckets: big enough to amortise a collective's latency, small enough that
# the flat copy is a fraction of the model's gradient memory.
_BUCKET_BYTES = 64 << 20


def _buckets(tensors: list[torch.Tensor], max_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive runs of same-dtype tensors of at most ``max_bytes`` (one tensor may exceed it)."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if not out or out[-1][0].dtype != t.dtype or size + nbytes > max_bytes:
            out.append([])
            size = 0
        out[-1].append(t)
        size += nbytes
    return out


def _broadcast(t: torch.Tensor, group: Any, device: torch.device) -> None:
    """``t`` from the group's first rank, in place (through ``device`` when gloo needs the CPU)."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    if t.device == device:
        dist.broadcast(t, src=src, group=group)
        return
    buf = t.detach().to(device)
    dist.broadcast(buf, src=src, group=group)
    t.copy_(buf)


class _PhaseClock:
    """Wall seconds of the step's phases (``time_<phase>_s`` metrics). On CUDA each lap
    synchronises the device: three syncs a step, against a step of seconds."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.seconds: dict[str, float] = {}
        self._last = self._now()

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def lap(self, phase: str) -> None:
        now = self._now()
        self.seconds[f"time_{phase}_s"] = now - self._last
        self._last = now


def resolve_device(device: str) -> torch.device:
    """``auto`` = the first GPU when there is one, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("trainer.device is 'cuda' but torch sees no CUDA device")
    return torch.device(device)


def make_micro_batches(
    groups: list[list[Completion]],
    advantages: torch.Tensor,
    micro_batch_size: int,
    pad_id: int,
    token_budget: int | None = None,
) -> list[MicroBatch]:
    """The step's completions as micro-batches.

    ``token_budget`` None: each prompt's rows in chunks of ``micro_batch_size`` (no prompt
    padding; the multimodal positions are those of an unbatched forward). A budget: rows of any
    prompts packed together, longest first, while a micro-batch holds at most
    ``micro_batch_size`` rows and ``rows x (widest prompt + longest completion)`` padded tokens
    — fewer, fuller forwards (a 48-layer step is launch-bound at one prompt's 8 rows), with the
    token counts balanced as the data-parallel shards balance theirs. Prompts are left-padded
    (masked) so every completion starts at the same column, the layout of generation.

    Empty completions (zero tokens) carry no gradient signal and are dropped here — they are still
    counted in the global normaliser by the caller, never silently reweighted.
    """
    rows = [(g, i, c) for g, group in enumerate(groups) for i, c in enumerate(group) if c.token_ids]
    for _, _, c in rows:
        if len(c.logprobs) != len(c.token_ids):
            raise ValueError(
                f"completion of {c.prompt.sample.uid!r}: {len(c.token_ids)} tokens but "
                f"{len(c.logprobs)} logprobs"
            )
    chunks: list[list[tuple[int, int, Completion]]] = []
    if token_budget is None:
        for g in range(len(groups)):
            mine = [r for r in rows if r[0] == g]
            chunks += [
                mine[s : s + micro_batch_size] for s in range(0, len(mine), micro_batch_size)
            ]
    else:
        longest_first = sorted(
            rows, key=lambda r: len(r[2].prompt.input_ids) + len(r[2].token_ids), reverse=True
        )
        width = length = 0
        for row in longest_first:
            w = max(width, len(row[2].prompt.input_ids))
            t = max(length, len(row[2].token_ids))
            full = chunks and (
                len(chunks[-1]) >= micro_batch_size
                or (len(chunks[-1]) + 1) * (w + t) > token_budget
            )
            if not chunks or full:
                chunks.append([])
                w, t = len(row[2].prompt.input_ids), len(row[2].token_ids)
            chunks[-1].append(row)
            width, length = w, t
    return [
        _micro_batch(chunk, advantages, pad_id, packed=token_budget is not None) for chunk in chunks
    ]


def _micro_batch(
    chunk: list[tuple[int, int, Completion]], advantages: torch.Tensor, pad_id: int, packed: bool
) -> MicroBatch:
    """One micro-batch's tensors (see ``make_micro_batches``)."""
    width = max(len(c.prompt.input_ids) for _, _, c in chunk)
    t = max(len(c.token_ids) for _, _, c in chunk)
    ids = torch.full((len(chunk), width + t), pad_id, dtype=torch.long)
    attn = torch.ones_like(ids)
    mask = torch.zeros(len(chunk), t, dtype=torch.bool)
    rollout = torch.zeros(len(chunk), t, dtype=torch.float32)
    for r, (_, _, c) in enumerate(chunk):
        p, n = len(c.prompt.input_ids), len(c.token_ids)
        ids[r, width - p : width] = torch.tensor(c.prompt.input_ids)
        attn[r, : width - p] = 0
        ids[r, width : width + n] = torch.tensor(c.token_ids)
        mask[r, :n] = True
        rollout[r, :n] = torch.tensor(c.logprobs)
    adv = torch.stack([advantages[g, i] for g, i, _ in chunk]).float()
    prompts = [c.prompt for _, _, c in chunk]
    if packed:
        mm = collate_mm([p.mm for p in prompts if p.mm])
    else:
        mm = repeat_mm(prompts[0].mm, len(chunk))
    return MicroBatch(prompts, ids, attn, mask, rollout, adv, width, mm)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` without making the host wait for the GPU: a host tensor bound for
    CUDA is staged in pinned memory first (torch's caching host allocator keeps the staging
    block until the copy's stream has read it). Why: a copy from pageable memory is staged by
    the driver, which may synchronise with the stream (CUDA's "API synchronization behavior"),
    so ``non_blocking=True`` alone does not keep the host ahead; pinned, the copy is queued
    behind the work before it and the host goes on."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device, non_blocking=True)


def media_on(mb: MicroBatch, device: torch.device) -> dict[str, torch.Tensor]:
    """``mb.mm`` built on ``device``: each distinct prompt's media tensors copied once, then
    joined there as ``_micro_batch`` joins them on the host (``collate_mm``; a prompt's rows
    repeat its media, and collating n copies of one prompt is ``repeat_mm``'s n blocks).

    Why: ``mb.mm`` holds a prompt's pixels and audio features once per row (a group's 8 rows: 8
    copies), and every forward of the micro-batch (the KL reference's, the policy's) copied all
    of them from pageable host memory in the GPU's stream: 27 and 51 copies, 57 and 50 ms of a
    20-layer exact update's profile on one H100
    (``benchmarks/results/one_gpu_thinker_phases_20l_h100.json``). The same tensors, the same
    values: each distinct one crosses the bus once per forward."""
    copied: dict[int, torch.Tensor] = {}

    def on_device(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in copied:
            copied[id(t)] = to_device(t, device)
        return copied[id(t)]

    rows = [{k: on_device(v) for k, v in p.mm.items()} for p in mb.prompts if p.mm]
    return collate_mm(rows) if rows else {}


class TorchBackend:
    """``TrainerBackend`` over an in-process ``OmniThinker`` (the module the embedded engine samples)."""

    name = "torch"

    def __init__(
        self,
        model: torch.nn.Module,
        trainer: TrainerConfig,
        algo: AlgoConfig,
        *,
        pad_token_id: int,
        device: torch.device | None = None,
        dp_group: Any = None,
    ) -> None:
        self.model = model
        self.cfg = trainer
        self.algo = algo
        self.pad_token_id = int(pad_token_id)
        self.device = device or resolve_device(trainer.device)
        self.model.to(self.device)
        # trainer.lora: peft adapters injected here, before the broadcast (A is random per rank)
        # and before the optimizer and reference copy are built over the trainable set.
        self.lora = trainer.lora is not None
        if trainer.lora is not None:
            from omni_grpo.models.lora import apply_lora

            apply_lora(self.model, trainer.lora)
        # Data parallel over ``dp_group`` (None: the default world) when torch.distributed is up.
        self.dp_group = dp_group
        self.dp_size = dp_world_size(dp_group)
        # where the step's collectives live: gloo takes CPU tensors, NCCL the rank's GPU
        self.collective_device = (
            self.device
            if self.dp_size == 1 or dist.get_backend(dp_group) == "nccl"
            else torch.device("cpu")
        )
        if self.dp_size > 1:
            with torch.no_grad():  # one starting point on every rank, as DDP guarantees
                for t in [*model.parameters(), *model.buffers()]:
                    _broadcast(t, self.dp_group, self.collective_device)
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no trainable parameters (everything is frozen)")
        # Fused on CUDA: the default multi-tensor AdamW allocates temporaries the size of the
        # optimizer state (benchmarks/vs_trl.py: -0.35 GiB peak on a 3 B-parameter step).
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=trainer.lr,
            betas=tuple(trainer.betas),
            weight_decay=trainer.weight_decay,
            fused=self.device.type == "cuda" or None,
        )
        if self.lora:  # fused AdamW leaves _version alone: the grouped experts' factor cache
            from omni_grpo.models.grouped_experts import invalidate_factor_caches

            self.optimizer.register_step_post_hook(lambda *_: invalidate_factor_caches(self.model))
        self.autocast_dtype = torch.bfloat16 if self.device.type == "cuda" else None
        # The KL reference. Full fine-tuning: a frozen copy of the model. LoRA: no copy — the base
        # weights are frozen, so the reference is the live module with its adapters disabled
        # (the untrained model; exact, since the base is never written) or, once anchored after
        # the warm-up, with the anchored adapter values swapped in for the forward
        # (``lora_reference``): a second model would cost as much memory as the policy (63 GB
        # for the 30B thinker), the adapters a fraction of a percent of it.
        self.reference: torch.nn.Module | None = None
        self.lora_reference: dict[str, torch.Tensor] | None = None
        self.has_reference = algo.kl_coef != 0
        if self.has_reference and not self.lora:
            self.reference = copy.deepcopy(model).eval()
            for p in self.reference.parameters():
                p.requires_grad_(False)
        if trainer.gradient_checkpointing:
            enable = getattr(model, "gradient_checkpointing_enable", None)
            if enable is None:
                raise ValueError(
                    f"trainer.gradient_checkpointing: {type(model).__name__} has no "
                    "gradient_checkpointing_enable()"
                )
            if trainer.checkpoint_policy == "selective":
                from omni_grpo.models.selective_checkpoint import selective_context_fn

                enable(context_fn=selective_context_fn(model))
            else:
                enable()
        # trainer.compile: the decoder layers' parts compiled, swapped in for the trainer's passes
        self.compiled = None
        if trainer.compile:
            from omni_grpo.models.compiled_layers import CompiledLayers

            self.compiled = CompiledLayers(model)
        self.steps_done = 0

    @property
    def is_driver(self) -> bool:
        """Rank 0 of the data-parallel world (or the only process) drives and checkpoints."""
        return self.dp_size == 1 or dist.get_rank(self.dp_group) == 0

    @property
    def exact(self) -> bool:
        """``rollout.exact_logprobs`` is on for the policy (``omni_grpo.exact``)."""
        return bool(getattr(self.model, "exact_logprobs", False))

    @property
    def exact_watch(self) -> Any:
        from omni_grpo.exact.watch import ExactnessWatch

        watch = self.__dict__.get("_exact_watch")
        if watch is None:
            watch = self.__dict__["_exact_watch"] = ExactnessWatch()
        return watch

    @property
    def policy(self) -> torch.nn.Module:
        """The live module: the embedded engine samples from it, so no weight sync is needed."""
        return self.model

    # ------------------------------------------------------------------ forward helpers
    @contextlib.contextmanager
    def _trainer_passes(self) -> Iterator[None]:
        """The context of a step's forwards, backward and recompute: the compiled layer parts
        (``trainer.compile``), and, under bf16 autocast, peft's LoRA layers take their input as it
        comes — peft would cast it to the fp32 adapters' dtype, and autocast straight back to bf16
        for the matmul: two passes over every adapted layer's input for bit-identical results."""
        with contextlib.ExitStack() as stack:
            if self.compiled is not None:
                if self.exact:  # exact forward, compiled recompute (models.compiled_layers)
                    self.compiled.exact_mode()
                stack.enter_context(self.compiled.active())
            if self.lora and self.autocast_dtype is not None:
                from peft.helpers import disable_input_dtype_casting

                stack.enter_context(disable_input_dtype_casting(self.model))
                if self.compiled is not None:  # the twins' adapters are their own modules
                    stack.enter_context(disable_input_dtype_casting(self.compiled.twins))
            yield

    def _autocast(self) -> Any:
        if self.autocast_dtype is None:
            return torch.autocast(self.device.type, enabled=False)
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _positions(self, mb: MicroBatch) -> dict[str, torch.Tensor]:
        """``position_ids`` for ``mb``'s forwards, computed on the host once per step.

        Why: left to the model, every forward of the micro-batch (the KL reference's, the
        policy's) computes its TM-RoPE positions again from the ids on the GPU, and omni-rope
        reads them back (its host path) or runs a ``nonzero`` (its device path): either stalls
        the host until the GPU has drained, so the GPU idled at each micro-batch's start until
        the host caught up (12 gaps of 6-14 ms in a 20-layer update's profile). From the
        micro-batch's own CPU tensors they are the same integers, with no stall. Empty for a
        model without ``compute_position_ids`` (it positions its rows itself)."""
        compute = getattr(self.model, "compute_position_ids", None)
        if compute is None:
            return {}
        if mb.position_ids is None:
            grids = ("image_grid_thw", "video_grid_thw", "video_second_per_grid")
            media = {k: mb.mm[k] for k in (*grids, "feature_attention_mask") if k in mb.mm}
            mb.position_ids, _ = compute(mb.input_ids, mb.attention_mask, **media)
        return {"position_ids": to_device(mb.position_ids, self.device)}

    def _logits(self, model: Callable[..., Any], mb: MicroBatch) -> torch.Tensor:
        """Logits at the positions that predict the completion tokens, ``[B, T, V]`` (``model``:
        a module, or a function of the same keyword arguments). Host-to-device copies do not
        wait for the GPU (:func:`to_device`: queued behind the work before them)."""
        ids = to_device(mb.input_ids, self.device)
        mm = mb.mm if self.device.type == "cpu" else media_on(mb, self.device)
        t = mb.mask.shape[1]
        # Exactly the t predicting positions, as a contiguous [B, t, V] tensor: a slice of t+1
        # would be copied by the logprob reshape and its gradient scattered back (2 x 0.6 GiB
        # per micro-batch of 8 x 256 tokens at V = 152k).
        keep = torch.arange(mb.prompt_len - 1, mb.prompt_len - 1 + t, device=self.device)
        with self._autocast():
            out = model(
                input_ids=ids,
                attention_mask=to_device(mb.attention_mask, self.device),
                logits_to_keep=keep,
                **self._positions(mb),
                **mm,
            )
        return out.logits

    def _token_logp(
        self, model: Callable[..., Any], mb: MicroBatch, temperature: float
    ) -> torch.Tensor:
        logits = self._logits(model, mb)
        targets = to_device(mb.input_ids[:, mb.prompt_len :], self.device)
        return token_logprobs_from_logits(logits, targets, temperature, exact=self.exact)

    def _reference_logits(self, mb: MicroBatch) -> torch.Tensor:
        """Logits under the KL reference (see ``__init__``), no grad. With
        ``rollout.exact_logprobs`` and LoRA, the live module's exact kernels with the adapters
        off: the KL term then measures how far the adapters moved the policy, never a difference
        of kernels — 0 at the untrained adapters, bit for bit, where torch's kernels gave 5.9e-5
        at 20 real-width layers, as much as four steps' drift
        (``benchmarks/results/one_gpu_thinker_reference_kernels_20l_h100.json``). Full
        fine-tuning's frozen copy keeps torch's kernels (it is copied before the switch)."""
        with torch.no_grad():
            if self.reference is not None:
                return self._logits(self.reference, mb)
            if self.lora_reference is None:
                from omni_grpo.models.lora import adapters_disabled

                with adapters_disabled(self.model):
                    return self._logits(self.model, mb)
            # the anchored adapters stand in for the live ones during this forward only
            # (torch.func.functional_call: nothing is written into the policy's parameters)
            model, state = self.model, self.lora_reference

            def swapped(**kwargs: Any) -> Any:
                return torch.func.functional_call(model, state, (), kwargs)

            return self._logits(swapped, mb)

    def _reference_logp(self, mb: MicroBatch, temperature: float) -> torch.Tensor:
        """Token logprobs under the KL reference, no grad."""
        targets = to_device(mb.input_ids[:, mb.prompt_len :], self.device)
        logits = self._reference_logits(mb)
        # the policy's log-softmax kernel too (exact mode): no kernel difference in the KL term
        return token_logprobs_from_logits(logits, targets, temperature, exact=self.exact).float()

    # ------------------------------------------------------------------ the update
    def step(self, batch: GRPOBatch) -> dict[str, float]:
        """One optimizer step over every completion of ``batch``; returns averaged metrics."""
        with self._trainer_passes():
            return self._grpo_step(batch)

    def _grpo_step(self, batch: GRPOBatch) -> dict[str, float]:
        self.model.train()
        apply_lr(self.optimizer, batch.lr)
        mbs = make_micro_batches(
            batch.groups,
            batch.advantages,
            self.cfg.micro_batch_size,
            self.pad_token_id,
            token_budget=self.cfg.micro_batch_tokens,
        )
        counts = global_counts(local_counts(batch), self.collective_device, self.dp_group)
        clock = _PhaseClock(self.device)
        old: list[torch.Tensor | None] = [None] * len(mbs)
        if self.cfg.ppo_epochs > 1:
            with torch.no_grad():
                old = [self._token_logp(self.model, mb, batch.temperature).float() for mb in mbs]
        clock.lap("old_logprobs")
        # kl_type full needs the reference's logits over the vocabulary: computed per micro-batch
        # in the loop below (one micro-batch of them alive at a time), not stored for all here.
        full_kl = self.algo.kl_type == "full"
        ref: list[torch.Tensor | None] = [None] * len(mbs)
        if self.has_reference and not full_kl:
            with torch.no_grad():
                ref = [self._reference_logp(mb, batch.temperature) for mb in mbs]
        clock.lap("reference")
        sums = DeferredMetrics()
        decisions: list[StepDecision] = []
        grad_norm = 0.0
        for _epoch in range(self.cfg.ppo_epochs):
            self.optimizer.zero_grad(set_to_none=True)
            for i, mb in enumerate(mbs):
                # kl_type full: the reference's logits first (with LoRA the reference forward
                # toggles the live adapters, which must not happen under a recorded graph)
                ref_logits = self._reference_logits(mb) if full_kl and self.has_reference else None
                logits = self._logits(self.model, mb)
                targets = to_device(mb.input_ids[:, mb.prompt_len :], self.device)
                logp = token_logprobs_from_logits(
                    logits, targets, batch.temperature, exact=self.exact
                )
                mask = to_device(mb.mask, self.device)
                rollout_logp = to_device(mb.rollout_logp, self.device)
                if self.exact and _epoch == 0:  # rollout.exact_logprobs: warn on a difference
                    step_no = self.steps_done + 1  # read at the step's end (flush)
                    self.exact_watch.queue(logp, mb, step_no, mask, rollout_logp)
                entropy = None
                if self.algo.entropy_coef != 0:
                    entropy = entropy_from_logits(logits, batch.temperature)
                kl = None
                if ref_logits is not None:
                    kl = forward_kl_from_logits(logits, ref_logits, batch.temperature)
                    del ref_logits
                old_logp = old[i] if old[i] is not None else logp.detach()
                loss, m = grpo_loss_terms(  # metrics stay on the device until the end
                    logp,
                    old_logp,
                    to_device(mb.advantages, self.device),
                    mask,
                    self.algo,
                    ref_logp=ref[i],
                    rollout_logp=rollout_logp,
                    entropy=entropy,
                    kl=kl,
                    num_samples=counts.num_samples,
                    num_tokens=counts.num_tokens,
                )
                loss.backward()
                sums.add(m, float(mb.mask.sum()))
            self._sum_gradients()
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.cfg.max_grad_norm))
            decisions.append(should_step(grad_norm, counts.has_signal, self.algo))
            if decisions[-1] == "step":
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.steps_done += 1
        clock.lap("policy")
        self.exact_watch.flush()
        return {
            **step_metrics(
                sums.resolve().reduce(self.dp_group),
                counts,
                grad_norm,
                decisions,
                current_lr(self.optimizer),
            ),
            **clock.seconds,
        }

    def _sum_gradients(self) -> None:
        """Sum every trainable parameter's gradient over the data-parallel ranks (no-op alone).

        One flag per parameter says whether any rank has a gradient for it; those that no rank
        touched keep ``grad=None`` so AdamW skips them exactly as it would in one process.
        """
        if self.dp_size == 1:
            return
        dev = self.collective_device
        present = torch.tensor([p.grad is not None for p in self.params], device=dev).float()
        dist.all_reduce(present, group=self.dp_group)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        for bucket in _buckets(grads, _BUCKET_BYTES):
            flat = torch.cat([g.reshape(-1) for g in bucket]).to(dev)
            dist.all_reduce(flat, group=self.dp_group)
            offset = 0
            for g in bucket:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        for p, g, n in zip(self.params, grads, present.tolist(), strict=True):
            p.grad = g if n > 0 else None

    def supervised_step(
        self, prompts: list[PromptInputs], targets: list[list[int]], lr: float
    ) -> float:
        """One cross-entropy step on ``targets`` (format warm-up); returns the mean token NLL.

        Data-parallel: each rank passes its share of the prompts; the token count is all-reduced
        so the update is the single-process one."""
        with self._trainer_passes():
            return self._supervised_step(prompts, targets, lr)

    def _supervised_step(
        self, prompts: list[PromptInputs], targets: list[list[int]], lr: float
    ) -> float:
        self.model.train()
        apply_lr(self.optimizer, lr)
        self.optimizer.zero_grad(set_to_none=True)
        local = torch.tensor([float(sum(len(t) for t in targets)), 0.0], dtype=torch.float64).to(
            self.collective_device
        )
        total_tokens = float(self._all_reduce(local.clone())[0])
        nll_sum = 0.0
        for prompt, target in zip(prompts, targets, strict=True):
            comp = Completion(
                prompt=prompt, token_ids=target, logprobs=[0.0] * len(target), finish_reason="stop"
            )
            (mb,) = make_micro_batches([[comp]], torch.zeros(1, 1), 1, self.pad_token_id)
            logp = self._token_logp(self.model, mb, 1.0)
            loss = -logp[mb.mask.to(self.device)].sum() / total_tokens
            loss.backward()
            nll_sum += float(loss.detach()) * total_tokens
        self._sum_gradients()
        norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.cfg.max_grad_norm))
        if math.isfinite(norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        apply_lr(self.optimizer, self.cfg.lr)
        local[1] = nll_sum
        nll_sum = float(self._all_reduce(local)[1])
        return nll_sum / max(total_tokens, 1.0)

    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.dp_size > 1:
            dist.all_reduce(t, group=self.dp_group)
        return t

    # ------------------------------------------------------------------ sync, checkpoint
    def weights_for_sync(self) -> tuple[NamedTensors, SourceLayout]:
        """Trainable weights under the VL names, as transformers holds them (``hf_memory``): a
        state dict of the live parameters (no copy), so the sync checks every name up front.
        With LoRA: the merged ``W + scale * B A`` of the adapted tensors only, under their base
        names (the server holds plain weights; what LoRA does not touch it already has) — but in
        exact mode the adapters themselves, live: the receiver is then an embedded rollout actor
        holding the same adapters (``ray.actors.RolloutActor``), and a merged weight's products
        would not round as the trainer's unmerged ones do."""
        if self.lora and self.exact:
            return {n: p for n, p in self.model.named_parameters() if p.requires_grad}, "hf_memory"
        if self.lora:
            from omni_grpo.models.lora import merged_weights

            return merged_weights(self.model), "hf_memory"
        sync = getattr(self.model, "sync_state_dict", None)  # OmniThinker; plain modules below
        if sync is not None:
            return sync(), "hf_memory"
        keep = {n for n, p in self.model.named_parameters() if p.requires_grad}
        return {k: v for k, v in self.model.state_dict().items() if k in keep}, "hf_memory"

    def set_reference(self, state: dict[str, torch.Tensor]) -> None:
        """Make the KL reference the policy with these trainable weights (the frozen rest is the
        same module state by construction). The trainer anchors it to the policy after the format
        warm-up — the SFT stage — instead of the untrained model it was copied from."""
        if not self.has_reference:
            return
        if self.reference is None:  # LoRA: the adapters' values, swapped in for the reference
            params = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
            if set(state) != set(params):
                raise ValueError("the KL reference's weights are not this run's LoRA adapters")
            self.lora_reference = {
                n: v.detach().to(params[n].device, params[n].dtype).clone()
                for n, v in state.items()
            }
            return
        params = dict(self.reference.named_parameters())
        with torch.no_grad():
            for name, value in state.items():
                params[name].copy_(value.to(params[name].device, params[name].dtype))

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """Trainable weights for a checkpoint (frozen parts are reloaded from the model directory);
        with LoRA, the adapters alone (``...lora_A.default.weight``, ``...lora_B...``)."""
        return {
            n: p.detach().cpu().clone() for n, p in self.model.named_parameters() if p.requires_grad
        }

    def load_trainable_state(self, state: dict[str, torch.Tensor]) -> None:
        params = dict(self.model.named_parameters())
        expected = {n for n, p in params.items() if p.requires_grad}
        if set(state) != expected:
            missing = sorted(expected - set(state))[:5]
            extra = sorted(set(state) - expected)[:5]
            raise ValueError(
                f"checkpoint weights do not match the trainable set: missing {missing}, unexpected {extra}"
            )
        with torch.no_grad():
            for name, value in state.items():
                if params[name].shape != value.shape:
                    raise ValueError(
                        f"checkpoint weight {name}: shape {tuple(value.shape)}, model has {tuple(params[name].shape)}"
                    )
                params[name].copy_(value.to(params[name].device, params[name].dtype))

    def optimizer_state(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "steps_done": self.steps_done}

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps_done = int(state.get("steps_done", 0))

    def close(self) -> None:
        """Nothing to release: the model and optimizer go with the object."""


def create_torch_backend(
    model_cfg: Any, trainer_cfg: Any, algo_cfg: Any, *, pad_token_id: int
) -> TorchBackend:
    """Entry point ``torch``: load the composed thinker (:func:`load_policy`) and wrap it."""
    device = resolve_device(trainer_cfg.device)
    model = load_policy(model_cfg, device)
    return TorchBackend(model, trainer_cfg, algo_cfg, pad_token_id=pad_token_id, device=device)


def load_policy(model_cfg: Any, device: torch.device) -> torch.nn.Module:
    """The composed thinker as ``model:`` says (``omni_grpo.models.load_thinker``): the trainer's
    policy, and each Ray rollout actor's copy, which must be the same module to the last flag
    (``ray.actors.RolloutActor``: its weights are kept equal by the sync, not by loading)."""
    from omni_grpo.models import load_thinker

    return load_thinker(
        model_cfg.extracted_dir,
        audio_dir=model_cfg.audio_dir,
        dtype=model_cfg.dtype,
        device=device,
        freeze_visual=model_cfg.freeze_visual,
        freeze_lm_head=model_cfg.freeze_lm_head,
    )
