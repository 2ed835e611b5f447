"""Batched, KV-cached sampling with the thinker, returning token ids and per-token logprobs.

One prefill forward over the (left- or right-padded) prompts with all their media, then one forward
per new token on the cache; positions continue from the prefill's rope deltas (see
``OmniThinker.forward``). Right-padded prompts are moved to left padding first so that every row's
next token sits at the same column.

Logprob convention (the one sglang/vLLM report and the trainer recomputes): the log-probability of
the sampled token under the temperature-scaled full distribution, ``log_softmax(logits / T)``;
top-k, top-p and suppressed ids only restrict which tokens can be drawn. Greedy (``T == 0``)
reports ``log_softmax(logits)``.

Suppressed ids default to the media placeholders and start markers: sampled into a completion they
would make the teacher-forced recompute look for media that does not exist.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from omni_grpo.models.thinker import OmniThinker


@dataclass
class GenerationResult:
    """``tokens``/``logprobs`` are ``[B, N]``; entries at or after ``lengths[i]`` are padding."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    lengths: torch.Tensor
    finish_reasons: list[str]

    def token_lists(self) -> list[list[int]]:
        return [self.tokens[i, : int(n)].tolist() for i, n in enumerate(self.lengths)]

    def logprob_lists(self) -> list[list[float]]:
        return [self.logprobs[i, : int(n)].tolist() for i, n in enumerate(self.lengths)]


def to_left_padding(
    input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Move each row's valid tokens to the right end (positions depend only on valid tokens)."""
    order = torch.argsort(attention_mask.long(), dim=1, stable=True)
    return input_ids.gather(1, order), attention_mask.gather(1, order)


def _restrict(
    scaled: torch.Tensor, top_k: int, top_p: float, suppress: torch.Tensor | None
) -> torch.Tensor:
    out = scaled.clone()
    if suppress is not None and suppress.numel():
        out[:, suppress] = float("-inf")
    if 0 < top_k < out.shape[-1]:
        kth = torch.topk(out, top_k, dim=-1).values[:, -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(out, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop_sorted = probs.cumsum(-1) - probs > top_p  # keep the smallest set reaching top_p
        out = out.masked_fill(
            torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), float("-inf")
        )
    return out


def sample_step(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_k: int = -1,
    top_p: float = 1.0,
    suppress: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row from ``[B, V]`` logits; return (tokens, logprobs) per the convention."""
    logits = logits.float()
    scaled = logits / temperature if temperature > 0 else logits
    logprobs = torch.log_softmax(scaled, dim=-1)
    allowed = _restrict(scaled, top_k, top_p, suppress)
    if temperature <= 0:
        tokens = allowed.argmax(-1)
    else:
        probs = torch.softmax(allowed, dim=-1)
        tokens = torch.multinomial(probs, 1, generator=generator)[:, 0]
    return tokens, logprobs.gather(-1, tokens[:, None])[:, 0]


def _cache_of(out: Any) -> Any:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)


@torch.no_grad()
def generate(
    thinker: OmniThinker,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    top_k: int = -1,
    top_p: float = 1.0,
    stop_token_ids: list[int] | None = None,
    suppress_token_ids: list[int] | None = None,
    pad_token_id: int = 0,
    generator: torch.Generator | None = None,
    **media: Any,
) -> GenerationResult:
    """Sample up to ``max_new_tokens`` per row; ``media`` are the Omni forward's media kwargs.

    A row stops after emitting a ``stop_token_ids`` token (kept, with its logprob). Rows that have
    stopped keep being fed ``pad_token_id`` (masked out) until all stop. ``suppress_token_ids``
    defaults to the thinker's media marker ids (``sideband.BANNED_ID_FIELDS``); pass ``[]`` to
    allow everything.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    device = thinker.device
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    input_ids, attention_mask = to_left_padding(input_ids.to(device), attention_mask.to(device))
    if suppress_token_ids is None:
        suppress_token_ids = thinker.sideband.banned_ids
    suppress = torch.tensor(sorted(set(suppress_token_ids)), dtype=torch.long, device=device)
    stop = torch.tensor(sorted(set(stop_token_ids or [])), dtype=torch.long, device=device)
    batch = input_ids.shape[0]
    media = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in media.items()}

    was_training = thinker.training
    thinker.eval()
    try:
        out = thinker(input_ids=input_ids, attention_mask=attention_mask, use_cache=True, **media)
        tokens, logprobs = [], []
        done = torch.zeros(batch, dtype=torch.bool, device=device)
        lengths = torch.full((batch,), max_new_tokens, dtype=torch.long, device=device)
        mask = attention_mask
        for step in range(max_new_tokens):
            tok, lp = sample_step(
                out.logits[:, -1, :],
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                suppress=suppress,
                generator=generator,
            )
            fed = (~done).long()[:, None]  # rows already stopped feed masked-out padding
            tok = torch.where(done, torch.full_like(tok, pad_token_id), tok)
            lp = torch.where(done, torch.zeros_like(lp), lp)
            tokens.append(tok)
            logprobs.append(lp)
            hit = torch.isin(tok, stop) & ~done
            lengths = torch.where(hit, torch.full_like(lengths, step + 1), lengths)
            done = done | hit
            if bool(done.all()) or step + 1 == max_new_tokens:
                break
            mask = torch.cat([mask, fed], dim=1)
            out = thinker(
                input_ids=tok[:, None], attention_mask=mask, cache=_cache_of(out), use_cache=True
            )
    finally:
        thinker.train(was_training)
    finished = ["stop" if bool(d) else "length" for d in done]
    return GenerationResult(
        tokens=torch.stack(tokens, 1).cpu(),
        logprobs=torch.stack(logprobs, 1).float().cpu(),
        lengths=lengths.cpu(),
        finish_reasons=finished,
    )
