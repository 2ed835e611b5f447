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

from typing import TYPE_CHECKING, Any

import torch

from omni_grpo.data.collate import collate_mm
from omni_grpo.models.continuous import RowPlan
from omni_grpo.models.generation import GenerationResult, check_rollout_fits, generate
from omni_grpo.types import Completion, PromptInputs, SamplingParams

if TYPE_CHECKING:
    from omni_grpo.rollout.in_flight import GroupInFlight


def resolve_batching(setting: str, on_cuda: bool, extra_groups: int = 0) -> str:
    """``rollout.embedded.batching``: ``auto`` is continuous on CUDA (long-tailed lengths: 1.26x
    the static decoder's tokens/s at 64 rows on one H200, par on uniform lengths) and with
    partial rollouts (``extra_groups``), and static on the CPU otherwise, where the demo's short,
    uniform completions gain nothing from refills."""
    if setting == "auto":
        return "continuous" if on_cuda or extra_groups else "static"
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
        memory_utilization: float = 0.85,
    ) -> None:
        if max_batch_rows < 1:
            raise ValueError(f"max_batch_rows must be >= 1, got {max_batch_rows}")
        if batching not in ("static", "continuous"):
            raise ValueError(f"batching must be 'static' or 'continuous', got {batching!r}")
        self.batching = batching
        self.memory_utilization = memory_utilization  # continuous: the slots' memory ceiling
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
            batching=resolve_batching(cfg.embedded.batching, on_cuda, cfg.embedded.extra_groups),
            memory_utilization=cfg.embedded.memory_utilization,
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
        # one row per prompt: generate() prefills it (media towers included) once and samples
        # its n completions from copies of that KV cache
        limits = None
        if self.length_plan is not None:
            limits = self._limits(self.length_plan(prompts, n), sampling)
        result = self._sample([p.input_ids for p in prompts], prompts, sampling, n, limits)
        tokens, logprobs = result.token_lists(), result.logprob_lists()
        return [
            [
                self.completion(prompt, tokens[row], logprobs[row], result.finish_reasons[row])
                for row in range(i * n, (i + 1) * n)
            ]
            for i, prompt in enumerate(prompts)
        ]

    @torch.no_grad()
    def continue_groups(
        self, groups: list[GroupInFlight], need: int, sampling: SamplingParams
    ) -> None:
        """Decode the unfinished samples of ``groups`` (partial rollouts, ``rollout.partial``)
        until ``need`` groups have every sample ended; the others stay as they stand.

        Fresh samples of a prompt share one prefill row; a sample resumed from earlier tokens
        gets its own (prompt + those tokens, recomputed with the current weights). Every sample
        draws with its own noise key, so it continues as if it had never stopped. Updates the
        samples in place."""
        rows = [(g, s) for g in groups for s in g.samples if s.reason is None]
        need -= sum(g.done for g in groups)
        if not rows or need <= 0:
            return
        prefill: list[tuple[PromptInputs, list[int]]] = []
        fresh_row: dict[int, int] = {}
        plan_rows = []
        for g, sample in rows:
            if sample.token_ids:
                plan_rows.append(len(prefill))
                prefill.append((g.prompt, sample.token_ids))
            else:
                if id(g) not in fresh_row:
                    fresh_row[id(g)] = len(prefill)
                    prefill.append((g.prompt, []))
                plan_rows.append(fresh_row[id(g)])
        index = {id(g): i for i, g in enumerate(groups)}
        plan = RowPlan(
            prefill_row=plan_rows,
            prefix=[s.token_ids for _, s in rows],
            prefix_logprobs=[s.logprobs for _, s in rows],
            keys=[s.key for _, s in rows],
            group=[index[id(g)] for g, _ in rows],
            need_groups=need,
        )
        limits = self._limits([s.limit or sampling.max_new_tokens for _, s in rows], sampling)
        result = self._sample(
            [p.input_ids + prefix for p, prefix in prefill],
            [p for p, _ in prefill],
            sampling,
            1,
            limits,
            plan=plan,
        )
        tokens, logprobs = result.token_lists(), result.logprob_lists()
        for r, (_, sample) in enumerate(rows):
            sample.advance(tokens[r], logprobs[r], result.finish_reasons[r])

    def _limits(self, planned: list[int], sampling: SamplingParams) -> torch.Tensor:
        return torch.tensor(planned, dtype=torch.long).clamp(1, sampling.max_new_tokens)

    def _sample(
        self,
        rows: list[list[int]],
        prompts: list[PromptInputs],
        sampling: SamplingParams,
        repeats: int,
        limits: torch.Tensor | None,
        plan: RowPlan | None = None,
    ) -> GenerationResult:
        """``generate`` over left-padded ``rows`` (each ``prompts[i]``'s ids, media collated)."""
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(rows):
            ids[i, width - len(r) :] = torch.tensor(r)
            mask[i, width - len(r) :] = 1
        mm = collate_mm([p.mm for p in prompts if p.mm])
        stop = sorted(set(self.eos_token_ids) | set(sampling.stop_token_ids))
        with self._autocast():
            return generate(
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
                repeats=repeats,
                row_limits=limits,
                batching=self.batching,
                max_slots=self.max_batch_rows,
                plan=plan,
                memory_utilization=self.memory_utilization,
                **mm,
            )

    def completion(
        self, prompt: PromptInputs, tokens: list[int], logprobs: list[float], reason: str
    ) -> Completion:
        version = self.version_fn() if self.version_fn is not None else "default"
        return Completion(
            prompt=prompt,
            token_ids=tokens,
            logprobs=logprobs,
            finish_reason=reason,
            weight_version=version,
            text=self.decode_fn(tokens) if self.decode_fn is not None else "",
        )
