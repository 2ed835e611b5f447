"""The embedded rollout engine: in-process sampling with the trainer's own weights.

No copy of the policy exists: the engine holds a reference to the very ``nn.Module`` the torch
backend optimises, so after ``optimizer.step()`` the next rollout already uses the new weights and
"weight sync" is a no-op. Generation is KV-cached (one prefill over the prompt with all its media,
then one token per forward); the logprob of each sampled token is taken from the same (temperature
scaled) distribution it was drawn from, which is what the trainer recomputes without a cache, so
their difference measures the cache/numerics mismatch only.

The ``n`` samples of one prompt run as one batch of ``n`` identical prompts: no padding is needed
(all rows have the same length until each stops), so positions (incl. the multimodal 3-D rope) are
exactly those of an unbatched forward.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from omni_grpo.data.collate import repeat_mm
from omni_grpo.types import Completion, PromptInputs, SamplingConfig


def cache_kwarg(model: torch.nn.Module) -> str:
    """The name under which this transformers version passes the KV cache (``cache`` or ``past_key_values``)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def sample_next(
    logits: torch.Tensor, sampling: SamplingConfig, banned: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row; return (tokens, their logprobs under the temperature-scaled distribution).

    top-k / top-p and ``banned`` ids only truncate the candidate set; the reported logprob is that of
    the full scaled distribution, the quantity the trainer recomputes (as sglang and vLLM report it).
    ``banned`` keeps media placeholder tokens out of completions: a sampled ``<|audio_pad|>`` would
    make the recompute look for audio features that do not exist.
    """
    logits = logits.float()
    scaled = logits / sampling.temperature if sampling.temperature > 0 else logits
    logprobs = torch.log_softmax(scaled, dim=-1)
    filtered = scaled.clone()
    if banned is not None and banned.numel():
        filtered[:, banned] = float("-inf")
    if sampling.temperature <= 0:
        tokens = filtered.argmax(dim=-1)
        return tokens, logprobs.gather(-1, tokens[:, None])[:, 0]
    if sampling.top_k > 0 and sampling.top_k < filtered.shape[-1]:
        kth = torch.topk(filtered, sampling.top_k, dim=-1).values[:, -1:]
        filtered = filtered.masked_fill(filtered < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(filtered, dim=-1, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative - torch.softmax(sorted_logits, dim=-1) > sampling.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        filtered = filtered.masked_fill(drop, float("-inf"))
    tokens = torch.multinomial(torch.softmax(filtered, dim=-1), 1)[:, 0]
    return tokens, logprobs.gather(-1, tokens[:, None])[:, 0]


class EmbeddedEngine:
    """``RolloutEngine`` over an in-process HF-style causal LM (the trainer's policy module).

    ``eos_token_ids`` end a sample (the stop token is kept in ``token_ids``, with its logprob, so the
    policy learns to stop). Sampling draws from torch's global RNG, which the run checkpoints, so a
    resumed run samples exactly what an uninterrupted one would.
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
    ) -> None:
        self.model = model
        self.eos_token_ids = list(eos_token_ids)
        self.device = torch.device(device)
        self.autocast_dtype = autocast_dtype
        self.decode_fn = decode_fn
        self.version_fn = version_fn
        self._cache_kw = cache_kwarg(model)
        self.banned = torch.tensor(
            sorted(set(banned_token_ids or [])), dtype=torch.long, device=self.device
        )

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
        return cls(
            policy,
            eos_token_ids or [],
            device=device,
            autocast_dtype=torch.bfloat16 if torch.device(device).type == "cuda" else None,
            decode_fn=context.get("decode_fn"),
            version_fn=context.get("version_fn"),
            banned_token_ids=context.get("banned_token_ids"),
        )

    def close(self) -> None:
        """Nothing to release: the engine borrows the trainer's module."""

    def _autocast(self) -> Any:
        if self.autocast_dtype is None:
            return torch.autocast(self.device.type, enabled=False)
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    @torch.no_grad()
    def generate(
        self, prompts: list[PromptInputs], n: int, sampling: SamplingConfig
    ) -> list[list[Completion]]:
        was_training = self.model.training
        self.model.eval()
        try:
            return [self._generate_group(p, n, sampling) for p in prompts]
        finally:
            self.model.train(was_training)

    def _generate_group(
        self, prompt: PromptInputs, n: int, sampling: SamplingConfig
    ) -> list[Completion]:
        stop = torch.tensor(
            sorted(set(self.eos_token_ids) | set(sampling.stop_token_ids)), device=self.device
        )
        ids = torch.tensor([prompt.input_ids] * n, dtype=torch.long, device=self.device)
        mm = {k: v.to(self.device) for k, v in repeat_mm(prompt.mm, n).items()}
        kwargs: dict[str, Any] = {"attention_mask": torch.ones_like(ids), "use_cache": True, **mm}
        if prompt.use_audio_in_video:
            kwargs["use_audio_in_video"] = True
        tokens: list[torch.Tensor] = []
        logprobs: list[torch.Tensor] = []
        done = torch.zeros(n, dtype=torch.bool, device=self.device)
        finished_at = torch.full(
            (n,), sampling.max_new_tokens, dtype=torch.long, device=self.device
        )
        with self._autocast():
            out = self.model(input_ids=ids, **kwargs)
            for t in range(sampling.max_new_tokens):
                tok, lp = sample_next(out.logits[:, -1, :], sampling, self.banned)
                tokens.append(tok)
                logprobs.append(lp)
                hit = torch.isin(tok, stop) & ~done
                finished_at = torch.where(hit, torch.full_like(finished_at, t + 1), finished_at)
                done |= hit
                if bool(done.all()) or t + 1 == sampling.max_new_tokens:
                    break
                cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
                out = self.model(input_ids=tok[:, None], use_cache=True, **{self._cache_kw: cache})
        tok_mat = torch.stack(tokens, dim=1).cpu()
        lp_mat = torch.stack(logprobs, dim=1).float().cpu()
        version = self.version_fn() if self.version_fn is not None else "default"
        group = []
        for i in range(n):
            length = int(finished_at[i])
            token_ids = tok_mat[i, :length].tolist()
            group.append(
                Completion(
                    prompt=prompt,
                    token_ids=token_ids,
                    logprobs=lp_mat[i, :length].tolist(),
                    finish_reason="stop" if bool(done[i]) else "length",
                    weight_version=version,
                    text=self.decode_fn(token_ids) if self.decode_fn is not None else "",
                )
            )
        return group
