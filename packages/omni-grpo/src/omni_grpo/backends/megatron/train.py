"""One GRPO update on the Megatron thinker, top to bottom.

``MegatronTrainer.step(batch)``: split the step's samples into micro-batches by
``max_tokens_per_gpu`` -> per micro-batch: forward (explicit M-RoPE ids), vocab-parallel token
logprobs, the SHARED ``omni_grpo.algo.grpo_loss`` with the step's global normalisers, backward ->
reduce grads across TP/DP/EP -> global grad norm, clip, skip on non-finite -> fp32-master AdamW.

Process-group setup (``init_parallel``) follows megatron-core: ``torch.distributed`` from the
torchrun environment, then ``parallel_state.initialize_model_parallel(tp, pp, ep, etp=1)``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from omni_grpo.algo import grpo_loss
from omni_grpo.backends.megatron._mcore import mcore
from omni_grpo.backends.megatron.batching import padded_length, plan_micro_batches
from omni_grpo.backends.megatron.config_map import ExpertsImpl, megatron_model_args
from omni_grpo.backends.megatron.export import export_hf_weights
from omni_grpo.backends.megatron.grads import finalize_grads, global_grad_norm
from omni_grpo.backends.megatron.model import (
    MegatronThinker,
    build_language_model,
    build_transformer_config,
    current_shard,
    load_language_model,
    load_visual,
    read_vl_config,
)
from omni_grpo.backends.megatron.optim import MasterAdamW
from omni_grpo.data.collate import collate_mm


def init_parallel(megatron: Any, seed: int = 0, backend: str | None = None) -> None:
    """Initialise torch.distributed (torchrun env, or a 1-process world) and megatron's groups."""
    ps = mcore().parallel_state
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.update(
                RANK="0",
                WORLD_SIZE="1",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=os.environ.get("MASTER_PORT", "29517"),
            )
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend or ("nccl" if torch.cuda.is_available() else "gloo"))
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=megatron.tp,
            pipeline_model_parallel_size=megatron.pp,
            expert_model_parallel_size=megatron.ep,
            expert_tensor_parallel_size=1,
        )
    if torch.cuda.is_available():
        mcore().model_parallel_cuda_manual_seed(seed)


def build_thinker(
    vl_dir: str | Path,
    megatron: Any,
    *,
    audio_dir: str | Path | None = None,
    experts_impl: ExpertsImpl = "grouped",
    freeze_lm_head: bool = False,
) -> MegatronThinker:
    """The Megatron thinker for this rank, weights loaded from omni-extract's ``vl`` (+ ``audio``) output."""
    cfg = read_vl_config(vl_dir)
    args = megatron_model_args(
        cfg,
        megatron,
        world_size=dist.get_world_size(),
        experts_impl=experts_impl,
        source=str(Path(vl_dir) / "config.json"),
    )
    lm = build_language_model(args, build_transformer_config(args))
    load_language_model(lm, vl_dir, args, current_shard())
    if freeze_lm_head:
        lm.output_layer.weight.requires_grad_(False)
    dev = next(lm.parameters()).device
    dtype = next(lm.parameters()).dtype
    visual = load_visual(vl_dir, dev, dtype) if "vision_config" in cfg else None
    audio = None
    if audio_dir is not None:
        from omni_audio_inject import AudioInjector, FrozenAudioTower

        audio = AudioInjector(FrozenAudioTower(audio_dir), int(args.token_ids["audio_token_id"]))
    return MegatronThinker(args, lm, visual=visual, audio=audio)


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


class ReferencePolicy:
    """The reference model for the KL term: a CPU copy of the initial trainable shards, swapped in
    for a no-grad forward (as miles keeps it), so no second model is ever resident on the GPU."""

    def __init__(self, thinker: MegatronThinker) -> None:
        self.params = [p for _, p in thinker.trainable_parameters()]
        self.cpu = [p.detach().to("cpu", copy=True) for p in self.params]

    def swapped(self) -> Any:
        from contextlib import contextmanager

        @contextmanager
        def ctx() -> Any:
            live = [p.data for p in self.params]
            try:
                for p, ref in zip(self.params, self.cpu, strict=True):
                    p.data = ref.to(p.device, non_blocking=True)
                yield
            finally:
                for p, data in zip(self.params, live, strict=True):
                    p.data = data

        return ctx()


@dataclass
class GRPOBatch:
    """The step's samples, already tokenised and positioned (one row per completion).

    ``input_ids[i]`` = prompt + response (unpadded); ``position_ids[i]`` its ``[3, L_i]`` M-RoPE ids
    (omni-rope); ``response_start[i]`` the index of the first response token; ``old_logp[i]`` /
    ``rollout_logp[i]`` / ``ref_logp[i]`` one value per response token; ``mm[i]`` its media tensors.
    """

    input_ids: list[torch.Tensor]
    position_ids: list[torch.Tensor]
    response_start: list[int]
    advantages: torch.Tensor
    old_logp: list[torch.Tensor] | None = None
    rollout_logp: list[torch.Tensor] | None = None
    ref_logp: list[torch.Tensor] | None = None
    mm: list[dict[str, torch.Tensor]] = field(default_factory=list)
    temperature: float = 1.0  # the rollout sampling temperature (logits are divided by it)


class MegatronTrainer:
    """The policy on megatron-core and its optimizer; ``step`` is one GRPO update."""

    def __init__(self, thinker: MegatronThinker, trainer_cfg: Any, algo_cfg: Any) -> None:
        self.thinker = thinker
        self.cfg = trainer_cfg
        self.algo = algo_cfg
        self.mcfg = trainer_cfg.megatron
        params = [p for _, p in thinker.trainable_parameters()]
        self.optim = MasterAdamW(
            params,
            lr=trainer_cfg.lr,
            betas=tuple(trainer_cfg.betas),
            weight_decay=trainer_cfg.weight_decay,
        )
        self.device = next(thinker.lm.parameters()).device
        self.reference = ReferencePolicy(thinker) if algo_cfg.kl_coef != 0 else None
        self.pad_multiple = self.mcfg.tp if thinker.lm.config.sequence_parallel else 1

    def _micro(self, batch: GRPOBatch, idx: list[int]) -> dict[str, Any]:
        s = padded_length(max(len(batch.input_ids[i]) for i in idx), self.pad_multiple)
        b = len(idx)
        ids = torch.zeros(b, s, dtype=torch.long)
        pos = torch.zeros(3, b, s, dtype=torch.float32)
        mask = torch.zeros(b, s - 1, dtype=torch.bool)
        per_tok: dict[str, torch.Tensor] = {}
        for name in ("old_logp", "rollout_logp", "ref_logp"):
            if getattr(batch, name) is not None:
                per_tok[name] = torch.zeros(b, s - 1)
        for r, i in enumerate(idx):
            n, st = len(batch.input_ids[i]), batch.response_start[i]
            ids[r, :n] = batch.input_ids[i]
            pos[:, r, :n] = batch.position_ids[i].float()
            pos[:, r, n:] = pos[:, r, n - 1 : n].max() + 1 + torch.arange(s - n)
            mask[r, st - 1 : n - 1] = True  # logits at t predict token t+1
            for name, buf in per_tok.items():
                vals = getattr(batch, name)[i]
                if vals.numel() != n - st:
                    raise ValueError(
                        f"sample {i}: {name} has {vals.numel()} values for {n - st} response tokens"
                    )
                buf[r, st - 1 : n - 1] = vals
        mm = collate_mm([batch.mm[i] for i in idx]) if batch.mm else {}
        dev = self.device
        return dict(
            ids=ids.to(dev),
            pos=pos.to(dev),
            mask=mask.to(dev),
            adv=batch.advantages[idx].to(dev),
            mm={k: v.to(dev) for k, v in mm.items()},
            **{k: v.to(dev) for k, v in per_tok.items()},
        )

    def logprobs_and_entropy(
        self, micro: dict[str, Any], temperature: float = 1.0, *, entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Token logprobs ``[B, S-1]`` and (when asked) per-token entropy of the micro-batch."""
        logits = self.thinker(micro["ids"], micro["pos"], micro["mm"])[:, :-1]  # [B, S-1, V/tp]
        if temperature > 0 and temperature != 1.0:
            logits = logits / temperature
        ent = vocab_parallel_entropy(logits) if entropy else None
        return vocab_parallel_logprobs(logits, micro["ids"][:, 1:]), ent

    def logprobs(self, micro: dict[str, Any], temperature: float = 1.0) -> torch.Tensor:
        return self.logprobs_and_entropy(micro, temperature)[0]

    def step(self, batch: GRPOBatch) -> dict[str, float]:
        lengths = [len(x) for x in batch.input_ids]
        plan = plan_micro_batches(lengths, self.mcfg.max_tokens_per_gpu)
        num_samples = float(len(lengths))
        num_tokens = float(sum(n - s for n, s in zip(lengths, batch.response_start, strict=True)))
        self.thinker.lm.train()
        self.optim.zero_grad()
        totals: dict[str, float] = {}
        micros = [self._micro(batch, idx) for idx in plan]
        if self.reference is not None:
            with torch.no_grad(), self.reference.swapped():
                for micro in micros:
                    micro["ref_logp"] = self.logprobs(micro, batch.temperature)
        for idx, micro in zip(plan, micros, strict=True):
            logp, ent = self.logprobs_and_entropy(
                micro, batch.temperature, entropy=self.algo.entropy_coef != 0
            )
            old = micro.get("old_logp")
            if old is None and not self.algo.use_rollout_logprobs:
                old = logp.detach()  # on-policy single epoch: ratio 1
            loss, metrics = grpo_loss(
                logp,
                old,
                micro["adv"],
                micro["mask"],
                self.algo,
                ref_logp=micro.get("ref_logp"),
                rollout_logp=micro.get("rollout_logp"),
                entropy=ent,
                num_samples=num_samples,
                num_tokens=num_tokens,
            )
            loss.backward()
            w = len(idx) / num_samples
            for k, v in metrics.items():
                totals[k] = totals.get(k, 0.0) + (
                    v
                    if k in ("loss", "pg_loss", "entropy_loss", "kl_loss", "response_tokens")
                    else v * w
                )
        finalize_grads(self.thinker.lm, self.thinker.lm.config.sequence_parallel)
        norm = float(global_grad_norm(self.thinker.lm))
        scale = (
            min(1.0, self.cfg.max_grad_norm / (norm + 1e-6))
            if math.isfinite(norm)
            else float("nan")
        )
        stepped = self.optim.step(scale)
        totals.update(
            grad_norm=norm, skipped_step=0.0 if stepped else 1.0, micro_batches=float(len(plan))
        )
        return totals

    def export(self) -> Any:
        """Full HF pseudo-VL tensors of the language model (collective), for weight sync."""
        return export_hf_weights(self.thinker.lm, self.thinker.args)
