"""The pieces every decoder of ``models.generation`` and ``models.continuous`` shares.

The sampler and its logprob convention (``sample_step``), the cache object the HF attention
layers write one decode slot to (``SlotCache``), the KV-size checks' errors and the CUDA-graph step
(``GraphStep``). Kept below both decoders so that neither imports the other's module.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from omni_grpo.models.decode_attention import SLOT_KW, START_KW
from omni_grpo.models.thinker import cache_arg_name

if TYPE_CHECKING:
    from omni_grpo.models.thinker import OmniThinker

log = logging.getLogger(__name__)

# ``(logits [N, V] fp32, targets [N]) -> [N]`` log-softmax at the targets.
TokenLogprobs = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# The thinker attribute holding the function its sampler takes each token's logprob with. Exact
# mode (``omni_grpo.exact.install``, a floor up: it needs Triton) puts the trainer's kernel there
# when it switches a thinker, so that the decoders call it without importing it; absent: torch's.
SAMPLER_LOGPROBS = "sampler_token_logprobs"

# How often (in decode steps) the host asks whether every row has stopped: each ask is a device
# sync, and a step after all rows stopped only costs one (graph-replayed) forward.
STOP_CHECK_EVERY = 16


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


# ------------------------------------------------------------------------------------- sampling
def _restrict(
    scaled: torch.Tensor, top_k: int, top_p: float, suppress: torch.Tensor | None
) -> torch.Tensor:
    """``scaled`` with every token that may not be drawn set to ``-inf`` (no host syncs)."""
    out = scaled.clone()
    if suppress is not None and suppress.numel():
        out.index_fill_(-1, suppress, float("-inf"))
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


def sampler_logprobs(thinker: torch.nn.Module) -> TokenLogprobs | None:
    """The logprob function a thinker's sampler must use (exact mode's kernel), or None."""
    return getattr(thinker, SAMPLER_LOGPROBS, None)


def sample_step(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_k: int = -1,
    top_p: float = 1.0,
    suppress: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    logprobs: TokenLogprobs | None = None,
    noise: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row from ``[B, V]`` logits; return (tokens, logprobs) per the convention.

    ``logprobs`` (:func:`sampler_logprobs`; with ``rollout.exact_logprobs`` the kernel the
    trainer uses, ``omni_grpo.exact.rowwise.token_logprobs``): the logprob comes from it, same
    value, bit for bit; None: torch's ``log_softmax``.

    The draw is ``torch.multinomial(probs, 1)``'s own algorithm (argmax of ``probs / Exp(1)``
    noise: the same tokens for the same RNG state) without its input checks, which read values
    back to the host and so could not run inside a CUDA graph. ``noise`` (``[B, V]`` Exp(1)
    draws) replaces the generator's: the continuous decoder keys it on each sample and position
    (``models.continuous.sample_noise``), so a row draws the same tokens whichever rows share
    its batch.
    """
    logits = logits.float()
    scaled = logits / temperature if temperature > 0 else logits
    allowed = _restrict(scaled, top_k, top_p, suppress)
    if temperature <= 0:
        tokens = allowed.argmax(-1)
    else:
        probs = torch.softmax(allowed, dim=-1)
        if noise is None:
            noise = torch.empty_like(probs).exponential_(1, generator=generator)
        tokens = (probs / noise).argmax(-1)
    if logprobs is not None:
        return tokens, logprobs(scaled, tokens)
    return tokens, torch.log_softmax(scaled, dim=-1).gather(-1, tokens[:, None])[:, 0]


# ------------------------------------------------------------------------------------- decoding
class SlotCache:
    """The cache object the HF attention layers write to: one fixed slot per decode step.

    ``slot``: ``[1]`` (every row writes the same column: the static decoder) or ``[B]`` (one
    column per row: the continuous decoder, whose rows started at different steps).
    """

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], slot: torch.Tensor):
        self.keys, self.values, self.slot = keys, values, slot

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *_: Any,
        **__: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.keys[layer_idx], self.values[layer_idx]
        if self.slot.numel() == 1:
            k.index_copy_(2, self.slot, key_states.to(k.dtype))
            v.index_copy_(2, self.slot, value_states.to(v.dtype))
        else:
            rows = torch.arange(k.shape[0], device=k.device)
            k[rows, :, self.slot] = key_states[:, :, 0].to(k.dtype)
            v[rows, :, self.slot] = value_states[:, :, 0].to(v.dtype)
        return k, v


def layer_tensors(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return [(layer.keys, layer.values) for layer in layers]
    return list(zip(cache.key_cache, cache.value_cache, strict=True))  # transformers < 4.56


class KVCacheTooLarge(ValueError):
    """The decode batch's static KV cache does not fit in the free device memory."""


def kv_cache_bytes(
    layer_kv: list[tuple[torch.Tensor, torch.Tensor]], rows: int, tokens: int
) -> int:
    """Bytes of the static K and V buffers for ``rows`` rows of ``tokens`` positions."""
    return sum(2 * rows * k.shape[1] * tokens * k.shape[3] * k.element_size() for k, _ in layer_kv)


def prefill_forward(
    thinker: OmniThinker, input_ids: torch.Tensor, attention_mask: torch.Tensor, **media: Any
) -> tuple[torch.Tensor, Any]:
    """The prompts' one forward with a cache (media towers included): the next-token logits
    ``[B, V]`` and the cache, which both decoders start from."""
    out = thinker(
        input_ids=input_ids,
        attention_mask=attention_mask,
        use_cache=True,
        logits_to_keep=1,
        **media,
    )
    cache = getattr(out, "cache", None)
    return out.logits[:, -1, :], cache if cache is not None else out.past_key_values


def free_device_bytes(device: torch.device) -> int:
    """Free memory of a CUDA device, counting what the caching allocator holds but does not use."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


class GraphStep:
    """A decoder whose ``step()`` touches only fixed tensors: on CUDA it is captured once as a
    CUDA graph and replayed (``StaticDecoder`` here, ``models.continuous.ContinuousDecoder``)."""

    graph: torch.cuda.CUDAGraph | None = None

    def bind(self, thinker: OmniThinker) -> None:
        """Keep the text decoder's parts a step runs (embedding, layers, norm, rope, LM head)."""
        lm = thinker.model.language_model
        self.embed, self.layers, self.norm, self.rotary = (
            lm.embed_tokens,
            lm.layers,
            lm.norm,
            lm.rotary_emb,
        )
        self.lm_head = thinker.lm_head
        self.cache_kw = cache_arg_name(self.layers[0].forward)

    def logits(
        self,
        tok: torch.Tensor,
        pos: torch.Tensor,
        slots: SlotCache,
        mask: torch.Tensor,
        start: torch.Tensor,
    ) -> torch.Tensor:
        """``[B, V]`` next-token logits of one fed token per row, its K/V written to ``slots``."""
        hidden = self.embed(tok[:, None])
        rope = self.rotary(hidden, pos)
        for layer in self.layers:
            out = layer(
                hidden,
                attention_mask=mask[:, None, None, :],
                position_embeddings=rope,
                **{self.cache_kw: slots, START_KW: start, SLOT_KW: slots.slot},
            )
            hidden = out[0] if isinstance(out, tuple) else out
        return self.lm_head(self.norm(hidden))[:, -1]

    def step(self) -> None:
        raise NotImplementedError

    def capture(self, warmup: int = 2) -> int:
        """Run ``warmup`` real steps on a side stream, then capture one step; returns steps run."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                self.step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        dtype = torch.get_autocast_dtype("cuda")
        autocast = torch.autocast(
            "cuda", dtype=dtype, enabled=torch.is_autocast_enabled("cuda"), cache_enabled=False
        )
        try:  # nothing runs while capturing, so a failed capture leaves the state untouched
            with autocast, torch.cuda.graph(graph):
                self.step()
        except RuntimeError as err:
            log.warning("decode step not capturable as a CUDA graph (%s); decoding eagerly", err)
            return warmup
        self.graph = graph
        return warmup

    def replay(self) -> None:
        if self.graph is None:
            self.step()
        else:
            self.graph.replay()
