"""``trainer.backend: megatron`` — the ``omni_grpo.backends`` entry point over :class:`MegatronTrainer`.

Takes the same ``GRPOBatch`` (groups of completions + advantages) as the torch backend, turns each
completion into prompt+response ids with EXPLICIT ``[3, L]`` M-RoPE positions from omni-rope
(computed over the full sequence with the prompt's media), and runs the Megatron GRPO step.

Scope, stated plainly: one process drives the model (``tp = ep = 1`` under the plain ``train``
command, or every rank of a ``torchrun`` launch running the same loop). The KL reference is a CPU
copy of the initial weights swapped in for a no-grad forward; entropy is vocab-parallel. The
supervised format warm-up is refused with a clear error rather than approximated. Weight sync gets full HF tensors gathered
across TP/EP on every rank.
"""

from __future__ import annotations

from typing import Any

import torch

from omni_grpo.backends.megatron.model import read_vl_config
from omni_grpo.backends.megatron.train import GRPOBatch as MegatronBatch
from omni_grpo.backends.megatron.train import MegatronTrainer, build_thinker, init_parallel


def completion_positions(prompt: Any, token_ids: list[int], rope_cfg: Any) -> torch.Tensor:
    """``[3, L]`` positions of prompt + response (omni-rope over the whole row, media from the prompt)."""
    from omni_rope import get_rope_index

    mm = prompt.mm
    ids = torch.tensor([list(prompt.input_ids) + list(token_ids)])
    pos, _ = get_rope_index(
        ids,
        None,
        rope_cfg,
        image_grid_thw=mm.get("image_grid_thw"),
        video_grid_thw=mm.get("video_grid_thw"),
        second_per_grids=mm.get("video_second_per_grid"),
        audio_seqlens=mm["feature_attention_mask"].sum(-1)
        if "feature_attention_mask" in mm
        else None,
        use_audio_in_video=prompt.use_audio_in_video,
    )
    return pos[:, 0]


class MegatronBackend:
    name = "megatron"
    model = None  # no HF module to share with the embedded engine: use rollout.engine sglang-omni
    sync_layout = "vl_hub"

    def __init__(
        self, trainer: MegatronTrainer, vl_config: dict[str, Any], trainer_cfg: Any, algo_cfg: Any
    ) -> None:
        from omni_rope import OmniRopeConfig

        self.trainer = trainer
        self.cfg = trainer_cfg
        self.algo = algo_cfg
        self.rope_cfg = OmniRopeConfig.from_vl_config(vl_config)
        self.device = trainer.device

    def _batch(self, batch: Any) -> MegatronBatch:
        ids, pos, starts, mm, rollout, adv = [], [], [], [], [], []
        for g, group in enumerate(batch.groups):
            for i, c in enumerate(group):
                if not c.token_ids:
                    continue  # no response token: no gradient signal (still counted by the caller's normaliser)
                p = c.prompt
                ids.append(torch.tensor(list(p.input_ids) + list(c.token_ids)))
                pos.append(completion_positions(p, c.token_ids, self.rope_cfg))
                starts.append(len(p.input_ids))
                mm.append(dict(p.mm))
                rollout.append(torch.tensor(c.logprobs, dtype=torch.float32))
                adv.append(float(batch.advantages[g, i]))
        return MegatronBatch(
            input_ids=ids,
            position_ids=pos,
            response_start=starts,
            advantages=torch.tensor(adv),
            rollout_logp=rollout,
            mm=mm,
            temperature=batch.temperature,
        )

    def step(self, batch: Any) -> dict[str, float]:
        mb = self._batch(batch)
        if self.cfg.ppo_epochs > 1:  # behaviour logprobs recomputed once, before the first update
            old = []
            with torch.no_grad():
                for i in range(len(mb.input_ids)):
                    one = self.trainer._micro(mb, [i])
                    old.append(self.trainer.logprobs(one, mb.temperature)[0][one["mask"][0]].cpu())
            mb.old_logp = old
        metrics: dict[str, float] = {}
        for _ in range(self.cfg.ppo_epochs):
            metrics = self.trainer.step(mb)
        metrics["lr"] = float(self.cfg.lr)
        return metrics

    def state_dict_for_sync(self) -> dict[str, torch.Tensor]:
        """Full HF tensors, fused experts as transformers' in-memory layout VIEWS (what ``push`` assumes
        by default); the sync transposes them back to the hub layout without a copy."""
        out = {}
        for name, t in self.trainer.export():
            out[name] = (
                t.transpose(1, 2)
                if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))
                else t
            )
        return out

    def trainable_state(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().cpu().clone() for n, p in self.trainer.thinker.trainable_parameters()}

    def load_trainable_state(self, state: dict[str, torch.Tensor]) -> None:
        params = dict(self.trainer.thinker.trainable_parameters())
        missing = sorted(set(params) - set(state))
        if missing:
            raise KeyError(
                f"checkpoint lacks {len(missing)} Megatron parameters, e.g. {missing[:3]}"
            )
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(state[n].to(p.device, p.dtype))
        for p, m in zip(self.trainer.optim.params, self.trainer.optim.masters, strict=True):
            m.data.copy_(p.detach().float())

    def optimizer_state(self) -> dict[str, Any]:
        return {"adamw": self.trainer.optim.opt.state_dict()}

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        self.trainer.optim.opt.load_state_dict(state["adamw"])

    def supervised_step(self, *args: Any, **kwargs: Any) -> float:
        raise NotImplementedError(
            "trainer.warmup (supervised format warm-up) is not implemented for the megatron backend"
        )


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
    return MegatronBackend(
        MegatronTrainer(thinker, trainer_cfg, algo_cfg),
        read_vl_config(model_cfg.extracted_dir),
        trainer_cfg,
        algo_cfg,
    )
