"""``trainer.backend: megatron`` — one GRPO update of the thinker on megatron-core, top to bottom.

``MegatronBackend.step(batch)`` takes the loop's ``GRPOBatch`` (groups of completions and their
advantages, ``omni_grpo.types``) and:

1. turns every completion with tokens into a row of prompt + response ids with EXPLICIT ``[3, L]``
   M-RoPE positions from omni-rope over the whole row and the prompt's media
   (:func:`completion_rows`); the loss normalisers count every completion, empty ones included
   (``omni_grpo.algo.step.local_counts``);
2. packs the rows into right-padded micro-batches by ``trainer.megatron.max_tokens_per_gpu``
   (first-fit decreasing, ``.batching``);
3. computes the reference logprobs (a CPU copy of the initial weights swapped in, no second model
   on the GPU) and, with ``ppo_epochs > 1``, the behaviour logprobs once before the first update;
4. per epoch and micro-batch: forward, vocab-parallel token logprobs (and entropy), the SHARED
   ``omni_grpo.algo.grpo_loss_terms`` with the step's global normalisers, backward;
5. reduces gradients across TP / DP / EP (``.grads``), takes the global grad norm, and lets
   ``omni_grpo.algo.step.should_step`` decide: clip and step the fp32-master AdamW (``.optim``),
   or skip for a non-finite norm, or skip when no completion carries signal;
6. reports ``omni_grpo.algo.step.step_metrics`` (token-weighted means, lr from the optimizer), the
   same metric set as the torch backend.

Ranks: every rank of one model-parallel replica (tp x ep) gets the SAME shard and runs ``step``
(collectives inside); data-parallel replicas get their own shards (``omni_grpo.algo.shard``), and
the normalisers, the signal flag and the metrics are reduced over megatron's data-parallel group,
with gradients summed over it (``.grads``), as the torch backend does over its world. Only dp = 1
has run on GPUs so far (tp 2 x ep 2 on two H200s); dp > 1 is written to the same rule. Weight sync streams
the export generator (full HF tensors gathered across TP/EP tensor by tensor, in the ``vl_hub``
layout) — every rank must drain it, the driver pushes it. The supervised format warm-up is
refused with a clear error rather than approximated. There is no HF module for an embedded engine
(``policy`` is None): use ``rollout.engine: sglang-omni``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from omni_grpo.algo import grpo_loss_terms
from omni_grpo.algo.step import (
    DeferredMetrics,
    StepDecision,
    apply_lr,
    current_lr,
    global_counts,
    local_counts,
    should_step,
    step_metrics,
)
from omni_grpo.backends.megatron._mcore import mcore
from omni_grpo.backends.megatron.batching import padded_length, plan_micro_batches
from omni_grpo.backends.megatron.export import export_hf_weights
from omni_grpo.backends.megatron.grads import finalize_grads, global_grad_norm
from omni_grpo.backends.megatron.model import (
    MegatronThinker,
    build_thinker,
    init_parallel,
    read_vl_config,
)
from omni_grpo.backends.megatron.optim import MasterAdamW
from omni_grpo.backends.megatron.vocab_parallel import (
    vocab_parallel_entropy,
    vocab_parallel_logprobs,
)
from omni_grpo.data.collate import collate_mm
from omni_grpo.types import GRPOBatch, NamedTensors, PromptInputs, SourceLayout


# ----------------------------------------------------------------------------- batch -> rows
def completion_positions(prompt: PromptInputs, token_ids: list[int], rope_cfg: Any) -> torch.Tensor:
    """``[3, L]`` positions of prompt + response (omni-rope over the whole row, media from the prompt)."""
    from omni_rope import positions_from_mm

    ids = torch.tensor([list(prompt.input_ids) + list(token_ids)])
    pos, _ = positions_from_mm(
        ids, None, prompt.mm, rope_cfg, use_audio_in_video=prompt.use_audio_in_video
    )
    return pos[:, 0]


@dataclass
class Row:
    """One completion as the Megatron model consumes it (unpadded)."""

    input_ids: torch.Tensor  # [L] prompt + response
    position_ids: torch.Tensor  # [3, L] M-RoPE ids
    response_start: int  # index of the first response token
    rollout_logp: torch.Tensor  # [L - response_start] engine logprobs
    advantage: float
    mm: dict[str, torch.Tensor]  # the prompt's media tensors


def completion_rows(batch: GRPOBatch, rope_cfg: Any) -> list[Row]:
    """Every completion with at least one token, in group order. Empty completions carry no token
    to train on; they are still counted by the normaliser (``local_counts`` reads the batch)."""
    rows = []
    for g, group in enumerate(batch.groups):
        for i, c in enumerate(group):
            if not c.token_ids:
                continue
            p = c.prompt
            if len(c.logprobs) != len(c.token_ids):
                raise ValueError(
                    f"completion of {p.sample.uid!r}: {len(c.token_ids)} tokens but "
                    f"{len(c.logprobs)} logprobs"
                )
            rows.append(
                Row(
                    input_ids=torch.tensor(list(p.input_ids) + list(c.token_ids)),
                    position_ids=completion_positions(p, c.token_ids, rope_cfg),
                    response_start=len(p.input_ids),
                    rollout_logp=torch.tensor(c.logprobs, dtype=torch.float32),
                    advantage=float(batch.advantages[g, i]),
                    mm=dict(p.mm),
                )
            )
    return rows


class ReferencePolicy:
    """The reference model for the KL term: a CPU copy of the initial trainable shards, swapped in
    for a no-grad forward (as miles keeps it), so no second model is ever resident on the GPU."""

    def __init__(self, thinker: MegatronThinker) -> None:
        self.params = [p for _, p in thinker.trainable_parameters()]
        self.cpu = [p.detach().to("cpu", copy=True) for p in self.params]

    @contextmanager
    def swapped(self) -> Iterator[None]:
        live = [p.data for p in self.params]
        try:
            for p, ref in zip(self.params, self.cpu, strict=True):
                p.data = ref.to(p.device, non_blocking=True)
            yield
        finally:
            for p, data in zip(self.params, live, strict=True):
                p.data = data


# ----------------------------------------------------------------------------- the backend
class MegatronBackend:
    """``TrainerBackend`` over the megatron-core thinker and its fp32-master AdamW."""

    name = "megatron"
    policy = None  # no HF module to share with the embedded engine: use rollout.engine sglang-omni

    def __init__(
        self, thinker: MegatronThinker, vl_config: dict[str, Any], trainer_cfg: Any, algo_cfg: Any
    ) -> None:
        from omni_rope import OmniRopeConfig

        self.thinker = thinker
        self.cfg = trainer_cfg
        self.algo = algo_cfg
        self.mcfg = trainer_cfg.megatron
        self.rope_cfg = OmniRopeConfig.from_vl_config(vl_config)
        self.optim = MasterAdamW(
            [p for _, p in thinker.trainable_parameters()],
            lr=trainer_cfg.lr,
            betas=tuple(trainer_cfg.betas),
            weight_decay=trainer_cfg.weight_decay,
        )
        self.device = next(thinker.lm.parameters()).device
        self.reference = ReferencePolicy(thinker) if algo_cfg.kl_coef != 0 else None
        self.pad_multiple = self.mcfg.tp if thinker.lm.config.sequence_parallel else 1

    @property
    def is_driver(self) -> bool:
        """Rank 0 drives (data, rollouts, sync.push); the others only step and export."""
        return not dist.is_initialized() or dist.get_rank() == 0

    def _dp_group(self) -> Any:
        """Megatron's data-parallel group (None in a process without ``torch.distributed``)."""
        if not dist.is_initialized():
            return None
        return mcore().parallel_state.get_data_parallel_group()

    # ------------------------------------------------------------------ forward helpers
    def _micro(self, rows: list[Row], idx: list[int]) -> dict[str, Any]:
        """Rows ``idx`` right-padded to one ``[B, S]`` block (``S`` a multiple of the SP size).

        ``mask [B, S-1]`` marks the logits that predict a response token (logits at t predict
        t+1); padding positions continue each row's positions so the causal forward never sees
        them before a real token.
        """
        s = padded_length(max(len(rows[i].input_ids) for i in idx), self.pad_multiple)
        b = len(idx)
        ids = torch.zeros(b, s, dtype=torch.long)
        pos = torch.zeros(3, b, s, dtype=torch.float32)
        mask = torch.zeros(b, s - 1, dtype=torch.bool)
        rollout = torch.zeros(b, s - 1)
        for r, i in enumerate(idx):
            row = rows[i]
            n, st = len(row.input_ids), row.response_start
            ids[r, :n] = row.input_ids
            pos[:, r, :n] = row.position_ids.float()
            pos[:, r, n:] = pos[:, r, n - 1 : n].max() + 1 + torch.arange(s - n)
            mask[r, st - 1 : n - 1] = True
            rollout[r, st - 1 : n - 1] = row.rollout_logp
        mm = collate_mm([rows[i].mm for i in idx])
        dev = self.device
        return dict(
            ids=ids.to(dev),
            pos=pos.to(dev),
            mask=mask.to(dev),
            tokens=float(mask.sum()),  # counted on the host: no read of the device mask
            rollout_logp=rollout.to(dev),
            adv=torch.tensor([rows[i].advantage for i in idx], device=dev),
            mm={k: v.to(dev) for k, v in mm.items()},
        )

    def _logprobs(
        self, micro: dict[str, Any], temperature: float, *, entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Token logprobs ``[B, S-1]`` and (when asked) per-token entropy of the micro-batch."""
        logits = self.thinker(micro["ids"], micro["pos"], micro["mm"])[:, :-1]  # [B, S-1, V/tp]
        if temperature > 0 and temperature != 1.0:
            logits = logits / temperature
        ent = vocab_parallel_entropy(logits) if entropy else None
        return vocab_parallel_logprobs(logits, micro["ids"][:, 1:]), ent

    # ------------------------------------------------------------------ the update
    def step(self, batch: GRPOBatch) -> dict[str, float]:
        """One optimizer step (``ppo_epochs`` updates) over every completion of ``batch``."""
        rows = completion_rows(batch, self.rope_cfg)
        dp_group = self._dp_group()
        counts = global_counts(local_counts(batch), self.device, dp_group)
        plan = plan_micro_batches([len(r.input_ids) for r in rows], self.mcfg.max_tokens_per_gpu)
        micros = [self._micro(rows, idx) for idx in plan]
        temperature = batch.temperature
        apply_lr(self.optim.opt, batch.lr)
        self.thinker.lm.train()
        if self.reference is not None:
            with torch.no_grad(), self.reference.swapped():
                for micro in micros:
                    micro["ref_logp"] = self._logprobs(micro, temperature)[0]
        if self.cfg.ppo_epochs > 1:  # behaviour logprobs once, under the rollout weights
            with torch.no_grad():
                for micro in micros:
                    micro["old_logp"] = self._logprobs(micro, temperature)[0]
        sums = DeferredMetrics()  # read once at the end: no host wait before each backward
        decisions: list[StepDecision] = []
        norm = 0.0
        for _epoch in range(self.cfg.ppo_epochs):
            self.optim.zero_grad()
            for micro in micros:
                logp, ent = self._logprobs(micro, temperature, entropy=self.algo.entropy_coef != 0)
                old = micro["old_logp"] if "old_logp" in micro else logp.detach()
                loss, metrics = grpo_loss_terms(
                    logp,
                    old,
                    micro["adv"],
                    micro["mask"],
                    self.algo,
                    ref_logp=micro.get("ref_logp"),
                    rollout_logp=micro["rollout_logp"],
                    entropy=ent,
                    num_samples=counts.num_samples,
                    num_tokens=counts.num_tokens,
                )
                loss.backward()
                sums.add(metrics, micro["tokens"])
            finalize_grads(self.thinker.lm, self.thinker.lm.config.sequence_parallel)
            norm = float(global_grad_norm(self.thinker.lm))
            decisions.append(should_step(norm, counts.has_signal, self.algo))
            if decisions[-1] == "step":
                self.optim.step(min(1.0, self.cfg.max_grad_norm / (norm + 1e-6)))
            self.optim.zero_grad()
        return step_metrics(
            sums.resolve().reduce(dp_group), counts, norm, decisions, current_lr(self.optim.opt)
        )

    def supervised_step(
        self, prompts: list[PromptInputs], targets: list[list[int]], lr: float
    ) -> float:
        raise NotImplementedError(
            "trainer.warmup (supervised format warm-up) is not implemented for the megatron backend"
        )

    # ------------------------------------------------------------------ sync, checkpoint
    def weights_for_sync(self) -> tuple[NamedTensors, SourceLayout]:
        """The export GENERATOR (full HF pseudo-VL tensors, gathered one by one across TP/EP) in
        the hub layout it produces: streamed into the sync bucket by bucket, never a dict.
        Collective: every rank must drain it."""
        return export_hf_weights(self.thinker.lm, self.thinker.args), "vl_hub"

    def trainable_state(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().cpu().clone() for n, p in self.thinker.trainable_parameters()}

    def load_trainable_state(self, state: dict[str, torch.Tensor]) -> None:
        params = dict(self.thinker.trainable_parameters())
        missing = sorted(set(params) - set(state))
        if missing:
            raise KeyError(
                f"checkpoint lacks {len(missing)} Megatron parameters, e.g. {missing[:3]}"
            )
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(state[n].to(p.device, p.dtype))
        for p, m in zip(self.optim.params, self.optim.masters, strict=True):
            m.data.copy_(p.detach().float())

    def optimizer_state(self) -> dict[str, Any]:
        return {"adamw": self.optim.opt.state_dict()}

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        self.optim.opt.load_state_dict(state["adamw"])

    def close(self) -> None:
        """Nothing to release here; megatron's process groups belong to the process."""


def create_megatron_backend(
    model_cfg: Any, trainer_cfg: Any, algo_cfg: Any, *, pad_token_id: int
) -> MegatronBackend:
    """Entry point ``omni_grpo.backends: megatron`` (``pad_token_id`` unused: batches are right-padded with 0
    and masked; padding never reaches a real token through the causal mask)."""
    if model_cfg.extracted_dir is None:
        raise ValueError(
            "model.extracted_dir: the megatron backend loads omni-extract's 'vl' output"
        )
    init_parallel(trainer_cfg.megatron)
    thinker = build_thinker(
        model_cfg.extracted_dir,
        trainer_cfg.megatron,
        audio_dir=model_cfg.audio_dir,
        freeze_lm_head=model_cfg.freeze_lm_head,
    )
    return MegatronBackend(thinker, read_vl_config(model_cfg.extracted_dir), trainer_cfg, algo_cfg)
