"""The torch backend: one GRPO update of ``load_thinker(...)`` on CPU or a single GPU.

``step(batch)`` reads top to bottom: split the step's completions into micro-batches (rows of one
prompt, at most ``micro_batch_size`` each, so no prompt padding and the multimodal positions are
those of an unbatched forward), forward prompt+completion, take the logprobs of the sampled tokens,
compute the shared GRPO loss (``omni_grpo.algo.grpo_loss``) with global normalisers so that the
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
reference copy exists only when ``algo.kl_coef != 0``.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from omni_grpo.algo import entropy_from_logits, grpo_loss, token_logprobs_from_logits
from omni_grpo.algo.step import (
    MetricSums,
    StepDecision,
    current_lr,
    global_counts,
    local_counts,
    should_step,
    step_metrics,
)
from omni_grpo.data.collate import repeat_mm
from omni_grpo.types import Completion, GRPOBatch, NamedTensors, PromptInputs, SourceLayout

if TYPE_CHECKING:
    from omni_grpo.config import AlgoConfig, TrainerConfig


@dataclass
class MicroBatch:
    """Rows of ONE prompt: prompt ids + right-padded completions, with their per-token data."""

    prompt: PromptInputs
    input_ids: torch.Tensor  # [B, L + T]
    mask: torch.Tensor  # [B, T] response tokens
    rollout_logp: torch.Tensor  # [B, T]
    advantages: torch.Tensor  # [B]
    prompt_len: int


def resolve_device(device: str) -> torch.device:
    """``auto`` = the first GPU when there is one, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("trainer.device is 'cuda' but torch sees no CUDA device")
    return torch.device(device)


def make_micro_batches(
    groups: list[list[Completion]], advantages: torch.Tensor, micro_batch_size: int, pad_id: int
) -> list[MicroBatch]:
    """Completions of each prompt in chunks of ``micro_batch_size`` rows, right-padded with ``pad_id``.

    Empty completions (zero tokens) carry no gradient signal and are dropped here — they are still
    counted in the global normaliser by the caller, never silently reweighted.
    """
    out: list[MicroBatch] = []
    for g, group in enumerate(groups):
        rows = [(i, c) for i, c in enumerate(group) if c.token_ids]
        for start in range(0, len(rows), micro_batch_size):
            chunk = rows[start : start + micro_batch_size]
            prompt = chunk[0][1].prompt
            t = max(len(c.token_ids) for _, c in chunk)
            ids = torch.full((len(chunk), len(prompt.input_ids) + t), pad_id, dtype=torch.long)
            mask = torch.zeros(len(chunk), t, dtype=torch.bool)
            rollout = torch.zeros(len(chunk), t, dtype=torch.float32)
            for r, (_, c) in enumerate(chunk):
                if len(c.logprobs) != len(c.token_ids):
                    raise ValueError(
                        f"completion of {prompt.sample.uid!r}: {len(c.token_ids)} tokens but "
                        f"{len(c.logprobs)} logprobs"
                    )
                n = len(c.token_ids)
                ids[r, : len(prompt.input_ids)] = torch.tensor(prompt.input_ids)
                ids[r, len(prompt.input_ids) : len(prompt.input_ids) + n] = torch.tensor(
                    c.token_ids
                )
                mask[r, :n] = True
                rollout[r, :n] = torch.tensor(c.logprobs)
            adv = advantages[g, [i for i, _ in chunk]].float()
            out.append(MicroBatch(prompt, ids, mask, rollout, adv, len(prompt.input_ids)))
    return out


class TorchBackend:
    """``TrainerBackend`` over an in-process ``OmniThinker`` (the module the embedded engine samples)."""

    name = "torch"
    is_driver = True

    def __init__(
        self,
        model: torch.nn.Module,
        trainer: TrainerConfig,
        algo: AlgoConfig,
        *,
        pad_token_id: int,
        device: torch.device | None = None,
    ) -> None:
        self.model = model
        self.cfg = trainer
        self.algo = algo
        self.pad_token_id = int(pad_token_id)
        self.device = device or resolve_device(trainer.device)
        self.model.to(self.device)
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no trainable parameters (everything is frozen)")
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=trainer.lr,
            betas=tuple(trainer.betas),
            weight_decay=trainer.weight_decay,
        )
        self.autocast_dtype = torch.bfloat16 if self.device.type == "cuda" else None
        self.reference: torch.nn.Module | None = None
        if algo.kl_coef != 0:
            self.reference = copy.deepcopy(model).eval()
            for p in self.reference.parameters():
                p.requires_grad_(False)
        self.steps_done = 0
        # where the step's small collectives (counts) live: gloo takes CPU tensors, NCCL the GPU's
        self.collective_device = self.device

    @property
    def policy(self) -> torch.nn.Module:
        """The live module: the embedded engine samples from it, so no weight sync is needed."""
        return self.model

    # ------------------------------------------------------------------ forward helpers
    def _autocast(self) -> Any:
        if self.autocast_dtype is None:
            return torch.autocast(self.device.type, enabled=False)
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _logits(self, model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
        """Logits at the positions that predict the completion tokens, ``[B, T, V]``."""
        ids = mb.input_ids.to(self.device)
        mm = {k: v.to(self.device) for k, v in repeat_mm(mb.prompt.mm, ids.shape[0]).items()}
        t = mb.mask.shape[1]
        with self._autocast():
            out = model(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                logits_to_keep=t + 1,
                **mm,
            )
        return out.logits[:, -(t + 1) : -1]

    def _token_logp(
        self, model: torch.nn.Module, mb: MicroBatch, temperature: float
    ) -> torch.Tensor:
        logits = self._logits(model, mb)
        targets = mb.input_ids[:, mb.prompt_len :].to(self.device)
        return token_logprobs_from_logits(logits, targets, temperature)

    # ------------------------------------------------------------------ the update
    def step(self, batch: GRPOBatch) -> dict[str, float]:
        """One optimizer step over every completion of ``batch``; returns averaged metrics."""
        self.model.train()
        mbs = make_micro_batches(
            batch.groups, batch.advantages, self.cfg.micro_batch_size, self.pad_token_id
        )
        counts = global_counts(local_counts(batch), self.collective_device)
        old: list[torch.Tensor | None] = [None] * len(mbs)
        if self.cfg.ppo_epochs > 1:
            with torch.no_grad():
                old = [self._token_logp(self.model, mb, batch.temperature).float() for mb in mbs]
        ref: list[torch.Tensor | None] = [None] * len(mbs)
        if self.reference is not None:
            with torch.no_grad():
                ref = [
                    self._token_logp(self.reference, mb, batch.temperature).float() for mb in mbs
                ]
        sums = MetricSums()
        decisions: list[StepDecision] = []
        grad_norm = 0.0
        for _epoch in range(self.cfg.ppo_epochs):
            self.optimizer.zero_grad(set_to_none=True)
            for i, mb in enumerate(mbs):
                logits = self._logits(self.model, mb)
                targets = mb.input_ids[:, mb.prompt_len :].to(self.device)
                logp = token_logprobs_from_logits(logits, targets, batch.temperature)
                entropy = None
                if self.algo.entropy_coef != 0:
                    entropy = entropy_from_logits(logits, batch.temperature)
                old_logp = old[i] if old[i] is not None else logp.detach()
                loss, m = grpo_loss(
                    logp,
                    old_logp,
                    mb.advantages.to(self.device),
                    mb.mask.to(self.device),
                    self.algo,
                    ref_logp=ref[i],
                    rollout_logp=mb.rollout_logp.to(self.device),
                    entropy=entropy,
                    num_samples=counts.num_samples,
                    num_tokens=counts.num_tokens,
                )
                loss.backward()
                sums.add(m, float(mb.mask.sum()))
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.cfg.max_grad_norm))
            decisions.append(should_step(grad_norm, counts.has_signal, self.algo))
            if decisions[-1] == "step":
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.steps_done += 1
        return step_metrics(sums, counts, grad_norm, decisions, current_lr(self.optimizer))

    def supervised_step(
        self, prompts: list[PromptInputs], targets: list[list[int]], lr: float
    ) -> float:
        """One cross-entropy step on ``targets`` (format warm-up); returns the mean token NLL."""
        self.model.train()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        total_tokens = float(sum(len(t) for t in targets))
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
        norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.cfg.max_grad_norm))
        if math.isfinite(norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        for group in self.optimizer.param_groups:
            group["lr"] = self.cfg.lr
        return nll_sum / max(total_tokens, 1.0)

    # ------------------------------------------------------------------ sync, checkpoint
    def weights_for_sync(self) -> tuple[NamedTensors, SourceLayout]:
        """Trainable weights under the VL names, as transformers holds them (``hf_memory``): a
        state dict of the live parameters (no copy), so the sync checks every name up front."""
        sync = getattr(self.model, "sync_state_dict", None)  # OmniThinker; plain modules below
        if sync is not None:
            return sync(), "hf_memory"
        keep = {n for n, p in self.model.named_parameters() if p.requires_grad}
        return {k: v for k, v in self.model.state_dict().items() if k in keep}, "hf_memory"

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """Trainable weights for a checkpoint (frozen parts are reloaded from the model directory)."""
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
    """Entry point ``torch``: load the composed thinker (``omni_grpo.models.load_thinker``) and wrap it."""
    from omni_grpo.models import load_thinker

    device = resolve_device(trainer_cfg.device)
    model = load_thinker(
        model_cfg.extracted_dir,
        audio_dir=model_cfg.audio_dir,
        dtype=model_cfg.dtype,
        device=device,
        freeze_visual=model_cfg.freeze_visual,
        freeze_lm_head=model_cfg.freeze_lm_head,
    )
    return TorchBackend(model, trainer_cfg, algo_cfg, pad_token_id=pad_token_id, device=device)
