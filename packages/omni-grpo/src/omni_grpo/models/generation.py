"""Batched, KV-cached sampling with the thinker: the one sampler of the project.

The embedded rollout engine, ``OmniThinker.generate`` and the tests all sample through this module.

One prefill forward over the (left- or right-padded) prompts with all their media, then one decode
step per new token. Right-padded prompts are moved to left padding first so that every row's next
token sits at the same column.

Decode steps run over fixed-size KV buffers (``StaticDecoder``): the prefill's cache is copied once
into buffers sized for the prompt plus ``max_new_tokens``, and each step writes one slot. Every
tensor a step touches therefore keeps its address and shape, so on CUDA the whole step (embed,
decoder layers, LM head, sampling, bookkeeping) is captured once as a CUDA graph and replayed:
decoding a few-layer MoE at small batch is launch-bound (hundreds of kernels per token), and a
replay removes the Python and launch cost of every step. Nothing in a step reads a value back to
the host; whether every row has stopped is checked only every ``STOP_CHECK_EVERY`` steps.

Logprob convention (the one sglang/vLLM report and the trainer recomputes): the log-probability of
the sampled token under the temperature-scaled full distribution, ``log_softmax(logits / T)``;
top-k, top-p and suppressed ids only restrict which tokens can be drawn. Greedy (``T == 0``)
reports ``log_softmax(logits)``.

Suppressed ids default to the media placeholders and segment markers
(``OmniSideband.banned_ids``): sampled into a completion they would make the teacher-forced
recompute look for media that does not exist.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from omni_grpo.models.continuous import RowPlan, decode_continuous, prefill_all
from omni_grpo.models.decode_attention import decode_attention
from omni_grpo.models.decode_kernels import decode_kernels
from omni_grpo.models.decode_step import (  # noqa: F401  (the sampler's public names live here)
    STOP_CHECK_EVERY,
    GenerationResult,
    GraphStep,
    KVCacheTooLarge,
    SlotCache,
    free_device_bytes,
    kv_cache_bytes,
    layer_tensors,
    prefill_forward,
    sample_step,
    sampler_logprobs,
)

if TYPE_CHECKING:
    from omni_grpo.models.thinker import OmniThinker


def to_left_padding(
    input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Move each row's valid tokens to the right end (positions depend only on valid tokens)."""
    order = torch.argsort(attention_mask.long(), dim=1, stable=True)
    return input_ids.gather(1, order), attention_mask.gather(1, order)


def kv_bytes_per_position(model: torch.nn.Module, dtype: torch.dtype | None = None) -> int:
    """K and V bytes one row's position takes in every text decoder layer, from the text config
    (the same buffers ``StaticDecoder`` allocates: layers x 2 x kv heads x head dim).

    ``dtype``: the cache's element type (the autocast dtype on CUDA); default the weights'.
    """
    cfg = model.config
    text = getattr(cfg, "text_config", None) or cfg
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if dtype is None:
        dtype = next(model.parameters()).dtype
    return text.num_hidden_layers * 2 * kv_heads * head_dim * dtype.itemsize


def check_rollout_fits(
    model: torch.nn.Module,
    rows: int,
    max_new_tokens: int,
    device: torch.device,
    dtype: torch.dtype | None = None,
) -> None:
    """Refuse at start-up, before the first step, a rollout batch whose KV cache cannot fit.

    The settings alone fix a lower bound: ``rows`` decode rows of ``max_new_tokens`` positions
    each, before a single prompt token (prompt lengths come from the data, so the exact size is
    checked again by ``check_kv_fits`` before each batch allocates). A run that could never
    generate a step stops here with the GiB it needs, not an hour later at the first rollout.
    """
    if device.type != "cuda":
        return
    need = rows * max_new_tokens * kv_bytes_per_position(model, dtype)
    free = free_device_bytes(device)
    if need > free:
        raise KVCacheTooLarge(
            f"the rollout's decode KV cache of {rows} rows x {max_new_tokens} new tokens needs at "
            f"least {need / 2**30:.1f} GiB before any prompt token, but {free / 2**30:.1f} GiB "
            "are free after loading the model: lower rollout.prompts_per_step, "
            "rollout.n_samples or rollout.sampling.max_new_tokens"
        )


def check_kv_fits(
    layer_kv: list[tuple[torch.Tensor, torch.Tensor]], rows: int, tokens: int, device: torch.device
) -> None:
    """Refuse, before allocating, a decode batch whose KV cache cannot fit on the GPU.

    The free memory counts what the caching allocator holds but does not use. The message names
    the settings that size the batch, so the run stops with the GiB it needs instead of an
    out-of-memory error in the middle of a step.
    """
    if device.type != "cuda":
        return
    need = kv_cache_bytes(layer_kv, rows, tokens)
    free = free_device_bytes(device)
    if need > free:
        raise KVCacheTooLarge(
            f"the decode KV cache of {rows} rows x {tokens} tokens needs {need / 2**30:.1f} GiB "
            f"but {free / 2**30:.1f} GiB are free: lower rollout.prompts_per_step, "
            "rollout.n_samples or rollout.sampling.max_new_tokens"
        )


class StaticDecoder(GraphStep):
    """Decode steps of a prefilled batch over fixed KV buffers; on CUDA, replayed as one graph.

    A step feeds the last sampled token of every row (rows that already stopped too: their extra
    tokens are cut off afterwards, and a row never attends to another), samples the next one and
    records it. Positions continue from the prefill's rope deltas exactly as
    ``models.positions.decode_positions`` computes them for an all-valid continuation.
    """

    def __init__(
        self,
        thinker: OmniThinker,
        cache: Any,
        attention_mask: torch.Tensor,
        first: tuple[torch.Tensor, torch.Tensor],
        max_new_tokens: int,
        sample: dict[str, Any],
        repeats: int = 1,
    ) -> None:
        self.bind(thinker)
        self.sample = sample
        # ``repeats``: the prefill ran once per prompt; each of its rows becomes ``repeats``
        # consecutive decode rows (the same KV, mask and positions: exact by construction)
        attention_mask = attention_mask.repeat_interleave(repeats, 0)
        batch, prompt_len = attention_mask.shape
        total = prompt_len + max_new_tokens
        device = attention_mask.device
        layer_kv = layer_tensors(cache)
        check_kv_fits(layer_kv, batch, total, device)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        for k, v in layer_kv:
            kb = k.new_zeros(batch, k.shape[1], total, k.shape[3])
            vb = v.new_zeros(batch, v.shape[1], total, v.shape[3])
            kb[:, :, :prompt_len] = k.repeat_interleave(repeats, 0)
            vb[:, :, :prompt_len] = v.repeat_interleave(repeats, 0)
            self.keys.append(kb)
            self.values.append(vb)
        self.mask = torch.zeros(batch, total, dtype=torch.bool, device=device)
        self.mask[:, :prompt_len] = attention_mask.bool()
        deltas = thinker.rope_deltas.to(device).repeat_interleave(repeats, 0)
        self.pos0 = attention_mask.long().sum(-1, keepdim=True) + deltas  # [B, 1]
        # left padding: row b's keys are [start[b], slot] (the decode kernel reads only those)
        self.start = (prompt_len - attention_mask.long().sum(-1)).to(torch.int32)
        self.fed = torch.zeros(1, dtype=torch.long, device=device)
        self.slot = torch.full((1,), prompt_len, dtype=torch.long, device=device)
        self.count = torch.ones(1, dtype=torch.long, device=device)
        tok, lp = first
        self.tok = tok.clone()
        self.tokens = torch.zeros(batch, max_new_tokens, dtype=torch.long, device=device)
        self.logprobs = torch.zeros(batch, max_new_tokens, dtype=torch.float32, device=device)
        self.tokens[:, 0] = tok
        self.logprobs[:, 0] = lp
        self.graph: torch.cuda.CUDAGraph | None = None

    def step(self) -> None:
        """Feed ``self.tok``, sample and record the next token (no host syncs)."""
        self.mask.index_fill_(1, self.slot, True)
        pos = (self.pos0 + self.fed).unsqueeze(0).expand(3, -1, -1)
        slots = SlotCache(self.keys, self.values, self.slot)
        logits = self.logits(self.tok, pos, slots, self.mask, self.start)
        tok, lp = sample_step(logits, **self.sample)
        self.tokens.index_copy_(1, self.count, tok[:, None])
        self.logprobs.index_copy_(1, self.count, lp[:, None].float())
        self.tok.copy_(tok)
        self.fed += 1
        self.slot += 1
        self.count += 1


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
    cuda_graph: bool | None = None,
    repeats: int = 1,
    row_limits: torch.Tensor | None = None,
    batching: str = "static",
    max_slots: int = 512,
    plan: RowPlan | None = None,
    memory_utilization: float = 0.85,
    **media: Any,
) -> GenerationResult:
    """Sample up to ``max_new_tokens`` per row; ``media`` are the Omni forward's media kwargs.

    A row stops after emitting a ``stop_token_ids`` token (kept, with its logprob); its later
    positions hold ``pad_token_id`` and logprob 0. ``suppress_token_ids`` defaults to the thinker's
    media marker ids (``sideband.BANNED_ID_FIELDS``); pass ``[]`` to allow everything.
    ``cuda_graph`` (default: on CUDA when sampling from the global RNG, unless
    ``OMNI_GRPO_CUDA_GRAPH=0``) replays the decode step as a CUDA graph; a private ``generator``
    keeps eager steps, since a graph replays only the global generator's stream.

    ``repeats``: sample that many completions of every prompt row (rows ``i * repeats + j`` of
    the result). The prompt, its media towers included, is prefilled once and its KV cache
    copied to the repeats: a GRPO group costs one prefill, not ``repeats``.

    ``row_limits`` (``[B * repeats]``, each <= ``max_new_tokens``): a row also ends after that
    many tokens (finish reason ``length``); the benchmarks draw them from a length
    distribution.

    ``batching``: ``static`` decodes the batch until its last row ends (``StaticDecoder``);
    ``continuous`` decodes through at most ``max_slots`` slots refilled as rows end and
    re-packed as they thin (``models.continuous``; its draws are keyed on each row, so a row's
    tokens do not depend on which rows share its batch), as many as fit under
    ``memory_utilization`` of the device's memory.
    """
    if batching not in ("static", "continuous"):
        raise ValueError(f"batching must be 'static' or 'continuous', got {batching!r}")
    if plan is not None and batching != "continuous":
        raise ValueError("a row plan (partial rollouts) needs batching 'continuous'")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    device = thinker.device
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    input_ids, attention_mask = to_left_padding(input_ids.to(device), attention_mask.to(device))
    if suppress_token_ids is None:
        suppress_token_ids = thinker.sideband.banned_ids
    suppress = torch.tensor(sorted(set(suppress_token_ids)), dtype=torch.long, device=device)
    stop = torch.tensor(sorted(set(stop_token_ids or [])), dtype=torch.long, device=device)
    valid = attention_mask.sum(-1).tolist()
    if plan is None:
        rows, longest = input_ids.shape[0] * repeats, max(valid)
    else:  # a resumed row's earlier tokens count towards its limit, not its prompt
        rows = len(plan.prefill_row)
        longest = max(valid[q] - len(t) for q, t in zip(plan.prefill_row, plan.prefix, strict=True))
    limits = _row_limits(row_limits, rows, max_new_tokens, device)
    check_context(thinker, int(longest), max_new_tokens)
    media = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in media.items()}
    sample = {
        "temperature": temperature,
        "top_k": top_k,
        "top_p": top_p,
        "suppress": suppress,
        "generator": generator,
        "logprobs": sampler_logprobs(thinker),  # exact mode's kernel (omni_grpo.exact)
    }
    if cuda_graph is None:
        enabled = os.environ.get("OMNI_GRPO_CUDA_GRAPH", "1") != "0"
        cuda_graph = enabled and device.type == "cuda" and generator is None

    was_training = thinker.training
    thinker.eval()
    try:
        if batching == "continuous":
            prefilled = prefill_all(thinker, input_ids, attention_mask, **media)
            layers = thinker.model.language_model.layers
            with decode_attention(layers), decode_kernels(thinker):
                return decode_continuous(
                    thinker,
                    prefilled,
                    repeats=repeats,
                    limits=limits,
                    max_new_tokens=max_new_tokens,
                    sample=sample,
                    stop=stop,
                    pad_token_id=pad_token_id,
                    cuda_graph=cuda_graph,
                    max_slots=max_slots,
                    generator=generator,
                    plan=plan,
                    memory_utilization=memory_utilization,
                )
        return _decode_static(
            thinker,
            input_ids,
            attention_mask,
            media,
            sample,
            stop,
            limits,
            repeats,
            cuda_graph,
            max_new_tokens=max_new_tokens,
            pad_token_id=pad_token_id,
        )
    finally:
        thinker.train(was_training)


def _decode_static(
    thinker: OmniThinker,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    media: dict[str, Any],
    sample: dict[str, Any],
    stop: torch.Tensor,
    limits: torch.Tensor,
    repeats: int,
    cuda_graph: bool,
    *,
    max_new_tokens: int,
    pad_token_id: int,
) -> GenerationResult:
    """One prefill, then ``StaticDecoder`` steps until every row ended (its stop token or limit)."""
    logits, cache = prefill_forward(thinker, input_ids, attention_mask, **media)
    first = sample_step(logits.repeat_interleave(repeats, 0), **sample)
    decoder = StaticDecoder(
        thinker, cache, attention_mask, first, max_new_tokens, sample, repeats=repeats
    )
    del logits, cache
    steps = 1  # tokens recorded so far
    with decode_attention(decoder.layers), decode_kernels(thinker):
        if cuda_graph and max_new_tokens > 3:
            steps += decoder.capture()  # eager steps if the step cannot be captured
        budget = int(limits.max())
        while steps < budget:
            if steps % STOP_CHECK_EVERY == 0 and _all_stopped(
                decoder.tokens[:, :steps], stop, limits
            ):
                break
            decoder.replay()
            steps += 1
    tokens, logprobs = decoder.tokens[:, :steps], decoder.logprobs[:, :steps]
    del decoder
    return _finish(tokens, logprobs, stop, limits, pad_token_id)


class ContextTooLong(ValueError):
    """A prompt plus its completion budget is longer than the model's context."""


def check_context(thinker: Any, prompt_tokens: int, max_new_tokens: int) -> None:
    """Refuse, before any forward, a prompt whose tokens plus ``max_new_tokens`` exceed the text
    model's ``max_position_embeddings``: positions past it were never trained, and the KV of
    such a row is allocated for nothing."""
    text = getattr(thinker.config, "text_config", None) or thinker.config
    context = getattr(text, "max_position_embeddings", None)
    if context is not None and prompt_tokens + max_new_tokens > int(context):
        raise ContextTooLong(
            f"a prompt of {prompt_tokens} tokens plus rollout.sampling.max_new_tokens "
            f"{max_new_tokens} exceeds the model's context of {int(context)} positions "
            "(text_config.max_position_embeddings): shorten the media (data.audio_max_seconds, "
            "data.max_frames, data.image_max_pixels) or lower max_new_tokens"
        )


def _row_limits(
    row_limits: torch.Tensor | None, rows: int, max_new_tokens: int, device: torch.device
) -> torch.Tensor:
    """Each row's token budget as a device tensor (``max_new_tokens`` where none is given)."""
    if row_limits is None:
        return torch.full((rows,), max_new_tokens, dtype=torch.long, device=device)
    limits = torch.as_tensor(row_limits, dtype=torch.long).to(device)
    if limits.shape != (rows,):
        raise ValueError(f"row_limits must hold one limit per row ({rows}), got {limits.shape}")
    if int(limits.min()) < 1 or int(limits.max()) > max_new_tokens:
        raise ValueError(f"row_limits must lie in [1, max_new_tokens={max_new_tokens}]")
    return limits


def _all_stopped(tokens: torch.Tensor, stop: torch.Tensor, limits: torch.Tensor) -> bool:
    ended = limits <= tokens.shape[1]
    if stop.numel():
        ended |= torch.isin(tokens, stop).any(-1)
    return bool(ended.all())


def _finish(
    tokens: torch.Tensor,
    logprobs: torch.Tensor,
    stop: torch.Tensor,
    limits: torch.Tensor,
    pad_token_id: int,
) -> GenerationResult:
    """Cut every row after its first stop token (kept) or at its limit; pad the rest."""
    hit = torch.isin(tokens, stop)
    stopped = hit.any(-1)
    first_stop = torch.where(stopped, hit.int().argmax(-1) + 1, tokens.shape[1])
    stopped &= first_stop <= limits
    first_stop = torch.minimum(first_stop, limits)
    lengths = first_stop
    valid = torch.arange(tokens.shape[1], device=tokens.device)[None] < first_stop[:, None]
    tokens = torch.where(valid, tokens, torch.full_like(tokens, pad_token_id))
    logprobs = torch.where(valid, logprobs, torch.zeros_like(logprobs))
    return GenerationResult(
        tokens=tokens.cpu(),
        logprobs=logprobs.float().cpu(),
        lengths=lengths.cpu(),
        finish_reasons=["stop" if bool(s) else "length" for s in stopped.cpu()],
    )
