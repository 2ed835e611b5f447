"""The embedded rollout engine: in-process sampling with the trainer's own weights.

No copy of the policy exists: the engine holds a reference to the very ``nn.Module`` the torch
backend optimises, so after ``optimizer.step()`` the next rollout already uses the new weights and
"weight sync" is a no-op.

Sampling is ``omni_grpo.models.generation.generate`` — the project's one sampler (logprob
convention, top-k/top-p, banned ids, static-KV decode replayed as a CUDA graph on GPU). Every
group of a step goes into ONE generation batch: the prompts are left-padded to a common length and
their media collated; each prompt is prefilled once (its vision/audio towers run once, not once
per sample) and its KV cache copied to the group's ``n`` decode rows, so a step costs one
prefill over the distinct prompts and ``max_new_tokens`` decode steps over all samples
(batches are split only above ``max_batch_rows`` rows). That is the ``static`` decoder; with
``batching: continuous`` (``rollout.embedded.batching``, the default on CUDA) the samples go
through at most ``max_batch_rows`` decode slots refilled as rows end (``models.continuous``). The logprob of each sampled token is taken from the same (temperature
scaled) distribution it was drawn from, which is what the trainer recomputes without a cache, so
their difference measures the cache/padding/numerics mismatch only.
"""

from __future__ import annotations

from typing import Any

import torch

from omni_grpo.data.collate import collate_mm
from omni_grpo.models.generation import check_rollout_fits, generate
from omni_grpo.types import Completion, PromptInputs, SamplingParams


def resolve_batching(setting: str, on_cuda: bool) -> str:
    """``rollout.embedded.batching``: ``auto`` is continuous on CUDA (long-tailed lengths: 1.26x
    the static decoder's tokens/s at 64 rows on one H200, par on uniform lengths) and static on
    the CPU, where the demo's short, uniform completions gain nothing from refills."""
    if setting == "auto":
        return "continuous" if on_cuda else "static"
    return setting


class EmbeddedEngine:
    """``RolloutEngine`` over the in-process ``OmniThinker`` (the trainer's policy module).

    ``eos_token_ids`` end a sample (the stop token is kept in ``token_ids``, with its logprob, so the
    policy learns to stop). ``banned_token_ids`` defaults to the policy's placeholder and media
    marker ids (``OmniSideband.banned_ids``). Sampling draws from torch's global RNG, which
    the run checkpoints, so a resumed run samples exactly what an uninterrupted one would.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        eos_token_ids: list[int],
        device: torch.device | str = "cpu",
        autocast_dtype: torch.dtype | None = None,
        decode_fn: Any = None,
        version_fn: Any = None,
        banned_token_ids: list[int] | None = None,
        max_batch_rows: int = 512,
        batching: str = "static",
        length_plan: Any = None,
    ) -> None:
        if max_batch_rows < 1:
            raise ValueError(f"max_batch_rows must be >= 1, got {max_batch_rows}")
        if batching not in ("static", "continuous"):
            raise ValueError(f"batching must be 'static' or 'continuous', got {batching!r}")
        self.batching = batching
        # ``length_plan(prompts, n) -> [len(prompts) * n]`` token budgets (benchmarks: drawn
        # completion lengths standing in for where a trained policy would stop)
        self.length_plan = length_plan
        self.model = model
        self.eos_token_ids = list(eos_token_ids)
        self.device = torch.device(device)
        self.autocast_dtype = autocast_dtype
        self.decode_fn = decode_fn
        self.version_fn = version_fn
        if banned_token_ids is None:
            sideband = getattr(model, "sideband", None)
            banned_token_ids = [] if sideband is None else sideband.banned_ids
        self.banned = sorted(set(banned_token_ids))
        self.max_batch_rows = max_batch_rows
        # Left padding of the batched prompts: any id that is no media placeholder (it is masked).
        self.pad_id = self.eos_token_ids[0] if self.eos_token_ids else 0

    @classmethod
    def from_rollout_config(
        cls,
        cfg: Any,
        *,
        policy: torch.nn.Module | None = None,
        eos_token_ids: list[int] | None = None,
        **context: Any,
    ) -> EmbeddedEngine:
        """Registry hook (``omni_grpo.rollout.create_engine``): share the trainer's ``policy``."""
        if policy is None:
            raise ValueError(
                "rollout.engine 'embedded' needs the trainer's in-process policy (torch backend)"
            )
        device = context.get("device", "cpu")
        on_cuda = torch.device(device).type == "cuda"
        engine = cls(
            policy,
            eos_token_ids or [],
            device=device,
            autocast_dtype=torch.bfloat16 if on_cuda else None,
            decode_fn=context.get("decode_fn"),
            version_fn=context.get("version_fn"),
            banned_token_ids=context.get("banned_token_ids"),
            batching=resolve_batching(cfg.embedded.batching, on_cuda),
        )
        engine.check_fits(cfg.prompts_per_step, cfg.n_samples, cfg.sampling.max_new_tokens)
        return engine

    def check_fits(self, prompts: int, n: int, max_new_tokens: int) -> None:
        """At start-up: refuse a step whose generation batch cannot hold its KV cache (the rows
        of one batch: every sample of the step, up to ``max_batch_rows``), with the GiB it needs."""
        per_batch = max(1, self.max_batch_rows // max(n, 1))
        rows = min(prompts, per_batch) * n
        if self.batching == "continuous":  # slots follow the free memory: one must fit
            rows = 1
        check_rollout_fits(self.model, rows, max_new_tokens, self.device, self.autocast_dtype)

    def close(self) -> None:
        """Nothing to release: the engine borrows the trainer's module."""

    def _autocast(self) -> Any:
        if self.autocast_dtype is None:
            return torch.autocast(self.device.type, enabled=False)
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    @torch.no_grad()
    def generate(
        self, prompts: list[PromptInputs], n: int, sampling: SamplingParams
    ) -> list[list[Completion]]:
        per_batch = max(1, self.max_batch_rows // max(n, 1))
        if self.batching == "continuous":  # one call: its slots hold at most max_batch_rows
            per_batch = len(prompts)
        groups: list[list[Completion]] = []
        for start in range(0, len(prompts), per_batch):
            groups.extend(self._generate_batch(prompts[start : start + per_batch], n, sampling))
        return groups

    def _generate_batch(
        self, prompts: list[PromptInputs], n: int, sampling: SamplingParams
    ) -> list[list[Completion]]:
        width = max(len(p.input_ids) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p.input_ids) :] = torch.tensor(p.input_ids)
            mask[i, width - len(p.input_ids) :] = 1
        # one row per prompt: generate() prefills it (media towers included) once and samples
        # its n completions from copies of that KV cache
        mm = collate_mm([p.mm for p in prompts if p.mm])
        stop = sorted(set(self.eos_token_ids) | set(sampling.stop_token_ids))
        limits = None
        if self.length_plan is not None:
            planned = self.length_plan(prompts, n)
            limits = torch.tensor(planned, dtype=torch.long).clamp(1, sampling.max_new_tokens)
        with self._autocast():
            result = generate(
                self.model,
                ids,
                mask,
                max_new_tokens=sampling.max_new_tokens,
                temperature=sampling.temperature,
                top_k=sampling.top_k,
                top_p=sampling.top_p,
                stop_token_ids=stop,
                suppress_token_ids=self.banned,
                pad_token_id=self.pad_id,
                repeats=n,
                row_limits=limits,
                batching=self.batching,
                max_slots=self.max_batch_rows,
                **mm,
            )
        version = self.version_fn() if self.version_fn is not None else "default"
        tokens, logprobs = result.token_lists(), result.logprob_lists()
        groups = []
        for i, prompt in enumerate(prompts):
            group = []
            for row in range(i * n, (i + 1) * n):
                group.append(
                    Completion(
                        prompt=prompt,
                        token_ids=tokens[row],
                        logprobs=logprobs[row],
                        finish_reason=result.finish_reasons[row],
                        weight_version=version,
                        text=self.decode_fn(tokens[row]) if self.decode_fn is not None else "",
                    )
                )
            groups.append(group)
        return groups
