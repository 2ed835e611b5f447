"""Continuous batching: a fixed set of decode slots, refilled as rows end, re-packed as they thin.

Why: the static decoder (``models.generation.StaticDecoder``) decodes one batch until its last
row stops, and every step computes every row, finished or not. Real GRPO completions are
long-tailed (most stop early, a few run to the limit), so most of its steps compute rows that
ended long ago. Here:

- **Slots.** The decode batch is ``slots`` rows, each with its own KV buffer of ``prompt +
  max_new_tokens`` columns, its own write column, position and token count (``[S]`` device
  tensors: a step reads nothing back to the host, so on CUDA it stays one replayed graph).
- **Refill.** Every ``STOP_CHECK_EVERY`` steps the host reads which slots ended, takes their
  tokens, and gives the slots to rows not started yet: the prompt's prefilled KV (every prompt
  of the call is prefilled once, towers included) is copied into the slot and its first token
  drawn from the prompt's last logits. More rows than slots (256 samples, a 4096-token limit)
  therefore fit on the card: memory follows the slots, not the rows.
- **Re-pack.** Once no row waits and at most half the slots still run, the live slots move into
  a batch half as large (a new graph is captured for it): the tail of a long-tailed step runs
  at the size of its live rows.
- **Sampling noise keyed on the row.** Each draw's Exp(1) noise is a hash of (the call's seed,
  the row, the token index, the vocabulary id) (``sample_noise``), not the next numbers of a
  shared RNG stream, so a row draws the same tokens whichever rows share its batch and whenever
  it started. The seed is drawn from torch's global RNG, which the run checkpoints.

With ``rollout.exact_logprobs`` the row-invariant kernels make a row's logits independent of
the other rows too: a row's tokens and logprobs are then bitwise those of the same row decoded
alone.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from omni_grpo.models.decode_step import (
    STOP_CHECK_EVERY,
    GenerationResult,
    GraphStep,
    KVCacheTooLarge,
    SlotCache,
    free_device_bytes,
    layer_tensors,
    prefill_forward,
    sample_step,
)

if TYPE_CHECKING:
    from omni_grpo.models.thinker import OmniThinker

log = logging.getLogger(__name__)

# Share of the free device memory the slots' KV buffers may take: the rest holds a step's
# activations, the logits and the sampling temporaries (a few [slots, vocab] fp32 tensors).
KV_SHARE = 0.85
_MASK32 = 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (two multiply-xorshift rounds) on int64 values in [0, 2^32)."""
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    return (x >> 16) ^ x


def sample_noise(seed: int, rows: torch.Tensor, index: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[B, vocab]`` Exp(1) draws, a pure function of (seed, row id, token index, vocab id).

    Odd multiples of 2^-24 as the uniforms: never 0 or 1, exact in fp32.
    """
    base = row_keys(seed, rows, index)
    if base.is_cuda:  # the same hash in one kernel (models.noise_kernel)
        from omni_grpo.models.noise_kernel import keyed_noise

        return keyed_noise(base, vocab)
    return keyed_noise_torch(base, vocab)


def row_keys(seed: int, rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Each draw's 32-bit key (``[B]`` int64): a hash of (seed, row id, token index)."""
    base = _hash32((rows.long() * 0x9E3779B1 + (seed & _MASK32)) & _MASK32)
    return _hash32((base ^ index.long()) & _MASK32)


def keyed_noise_torch(base: torch.Tensor, vocab: int) -> torch.Tensor:
    """:func:`sample_noise`'s draws from each row's key, in torch (CPU; the kernel's reference)."""
    cols = torch.arange(vocab, device=base.device, dtype=torch.long)
    bits = _hash32((base[:, None] + cols[None, :] * 0x2545F491) & _MASK32)
    uniform = ((bits >> 8) | 1).float() * (1.0 / (1 << 24))
    return -torch.log(uniform)


@dataclass
class Prefilled:
    """Every prompt of the call after one prefill: the copies a slot is filled from."""

    keys: list[torch.Tensor]  # per layer [P, KVH, Lp, D], left-padded
    values: list[torch.Tensor]
    mask: torch.Tensor  # [P, Lp] bool
    pos0: torch.Tensor  # [P] long: the first decode position (valid tokens + rope delta)
    start: torch.Tensor  # [P] int32: the first real key column
    logits: torch.Tensor  # [P, V] fp32: the next-token logits after the prompt

    @property
    def width(self) -> int:
        return int(self.mask.shape[1])


@dataclass
class RowPlan:
    """Rows that are not ``repeats`` fresh samples of each prompt: partial rollouts.

    ``prefill_row[r]``: the prefilled row sample ``r`` starts from (its prompt, or its prompt
    followed by ``prefix[r]``, the tokens an earlier call sampled: they are recorded again, with
    ``prefix_logprobs[r]``, and count towards the row's limit); ``keys[r]``: its noise key (the
    same draws at the same index whichever call decodes it, so a resumed sample continues as if
    it had never stopped, weights unchanged); ``group[r]``: its group. With ``need_groups`` the
    call returns once that many groups have every row ended, the others as they stand.

    Cost: a resumed row's prefill row holds its prompt and earlier tokens, and every slot is as
    wide as the widest prefill row plus ``max_new_tokens``; long continued samples widen the
    slots (fewer fit) for the call.
    """

    prefill_row: list[int]
    prefix: list[list[int]]
    prefix_logprobs: list[list[float]]
    keys: list[int]
    group: list[int]
    need_groups: int | None = None


def slot_bytes(prefilled: Prefilled, max_new_tokens: int) -> int:
    """K and V bytes of one slot: every layer, ``prompt + max_new_tokens`` columns."""
    total = prefilled.width + max_new_tokens
    return sum(2 * k.shape[1] * total * k.shape[3] * k.element_size() for k in prefilled.keys)


def device_total_and_allocated(device: torch.device) -> tuple[int, int]:
    """The device's memory and what live tensors take of it (model, optimizer, prefill)."""
    return torch.cuda.get_device_properties(device).total_memory, torch.cuda.memory_allocated(
        device
    )


def plan_slots(
    prefilled: Prefilled,
    rows: int,
    max_new_tokens: int,
    device: torch.device,
    cap: int,
    memory_utilization: float = 0.85,
) -> int:
    """How many slots: every row if they fit (and ``cap`` allows), else what the memory holds:
    ``KV_SHARE`` of the free memory, and no more than brings the allocation to
    ``memory_utilization`` of the device (``rollout.embedded.memory_utilization``: a peak the
    user sets, not one that depends on what the caching allocator happens to hold). Refuses,
    before allocating, a call whose single slot cannot fit."""
    want = max(1, min(rows, cap))
    if device.type != "cuda":
        return want
    per = slot_bytes(prefilled, max_new_tokens)
    vocab = prefilled.logits.shape[-1]
    per_row_temps = 8 * 4 * vocab  # logits, probs, noise and their int64 hashes, fp32 / int64
    free = free_device_bytes(device)
    total, allocated = device_total_and_allocated(device)
    budget = min(KV_SHARE * free, memory_utilization * total - allocated)
    fit = int(max(0.0, budget)) // (per + per_row_temps)
    if fit < 1:
        raise KVCacheTooLarge(
            f"one decode slot of {prefilled.width} prompt + {max_new_tokens} new tokens needs "
            f"{per / 2**30:.2f} GiB of KV cache but {max(0.0, budget) / 2**30:.2f} GiB are left "
            f"({free / 2**30:.2f} GiB free, rollout.embedded.memory_utilization "
            f"{memory_utilization}): lower rollout.sampling.max_new_tokens or the prompts' "
            "media lengths"
        )
    return min(want, fit)


class ContinuousDecoder(GraphStep):
    """``slots`` decode rows over the call's ``rows`` samples (see the module docstring).

    ``row_prompt[r]``: the prompt of sample row ``r``; ``limits[r]``: its token budget. Host
    state: which row each slot holds (``held``), the next row to start, each row's length.
    """

    # the per-slot device tensors a re-pack moves, and what an idle slot holds
    STATE = (
        "mask",
        "start",
        "pos0",
        "fed",
        "column",
        "count",
        "limit",
        "row",
        "tok",
        "done",
        "ones",
    )
    IDLE: dict[str, Any] = {"done": True, "mask": False}

    def __init__(
        self,
        thinker: OmniThinker,
        prefilled: Prefilled,
        row_prompt: torch.Tensor,
        limits: torch.Tensor,
        max_new_tokens: int,
        slots: int,
        sample: dict[str, Any],
        seed: int,
        stop: torch.Tensor,
        plan: RowPlan | None = None,
    ) -> None:
        self.bind(thinker)
        self.pre, self.sample, self.seed, self.stop = prefilled, sample, seed, stop
        self.row_prompt, self.limits = row_prompt, limits
        self.max_new = max_new_tokens
        rows = row_prompt.shape[0]
        device = prefilled.mask.device
        # row ``rows`` and column ``max_new`` are scratch: an idle slot's draw lands there
        self.out_tokens = torch.zeros(rows + 1, max_new_tokens + 1, dtype=torch.long, device=device)
        self.out_logprobs = torch.zeros(rows + 1, max_new_tokens + 1, device=device)
        keys = list(range(rows)) if plan is None else list(plan.keys)
        self.row_keys = torch.tensor([*keys, 0], dtype=torch.long, device=device)
        self.first_index = torch.zeros(rows, dtype=torch.long, device=device)
        if plan is not None:  # resumed rows: their earlier tokens are recorded first
            for r, (toks, lps) in enumerate(zip(plan.prefix, plan.prefix_logprobs, strict=True)):
                if toks:
                    self.out_tokens[r, : len(toks)] = torch.tensor(toks)
                    self.out_logprobs[r, : len(lps)] = torch.tensor(lps)
                    self.first_index[r] = len(toks)
        self.lengths: list[int | None] = [None] * rows
        self.next_row = 0
        self._allocate(slots, device)

    # ----------------------------------------------------------------------------- slot state
    def _allocate(self, slots: int, device: torch.device) -> None:
        total = self.pre.width + self.max_new
        # zeros, not empty: SDPA (the CPU path) weighs masked keys by 0, and 0 * NaN garbage is NaN
        self.keys = [k.new_zeros(slots, k.shape[1], total, k.shape[3]) for k in self.pre.keys]
        self.values = [v.new_zeros(slots, v.shape[1], total, v.shape[3]) for v in self.pre.values]
        long = dict(dtype=torch.long, device=device)
        self.mask = torch.zeros(slots, total, dtype=torch.bool, device=device)
        self.start = torch.zeros(slots, dtype=torch.int32, device=device)
        self.pos0 = torch.zeros(slots, **long)
        self.fed = torch.zeros(slots, **long)
        self.column = torch.zeros(slots, **long)  # where the fed token's K/V is written
        self.count = torch.zeros(slots, **long)  # tokens recorded for the slot's row
        self.limit = torch.ones(slots, **long)
        self.row = torch.full((slots,), self.row_prompt.shape[0], **long)
        self.tok = torch.zeros(slots, **long)
        self.done = torch.ones(slots, dtype=torch.bool, device=device)
        self.ones = torch.ones(slots, dtype=torch.bool, device=device)
        self.held: list[int | None] = [None] * slots
        self.graph = None

    @property
    def slots(self) -> int:
        return len(self.held)

    def pending(self) -> int:
        return self.row_prompt.shape[0] - self.next_row

    def refill(self) -> None:
        """Give every free slot the next row not started yet (prompt KV copied, first token)."""
        free = [s for s, r in enumerate(self.held) if r is None]
        take = min(len(free), self.pending())
        if not take:
            return
        device = self.mask.device
        slots = torch.tensor(free[:take], device=device)
        rows = torch.arange(self.next_row, self.next_row + take, device=device)
        for s, r in zip(free[:take], range(self.next_row, self.next_row + take), strict=True):
            self.held[s] = r
        self.next_row += take
        prompt = self.row_prompt[rows]
        width = self.pre.width
        for dst, src in zip(self.keys + self.values, self.pre.keys + self.pre.values, strict=True):
            dst[slots, :, :width] = src[prompt]
        self.mask[slots] = False
        self.mask[slots, :width] = self.pre.mask[prompt]
        self.start[slots] = self.pre.start[prompt]
        self.pos0[slots] = self.pre.pos0[prompt]
        self.fed[slots] = 0
        self.column[slots] = width
        self.row[slots] = rows
        self.limit[slots] = self.limits[rows]
        index = self.first_index[rows]  # 0, or after a resumed row's earlier tokens
        tok, lp = self._draw(self.pre.logits[prompt], self.row_keys[rows], index)
        self.out_tokens[rows, index] = tok
        self.out_logprobs[rows, index] = lp.float()
        self.tok[slots] = tok
        self.count[slots] = index + 1
        self.done[slots] = torch.isin(tok, self.stop) | (self.limit[slots] <= index + 1)

    def _draw(
        self, logits: torch.Tensor, rows: torch.Tensor, index: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        noise = None
        if self.sample["temperature"] > 0:
            noise = sample_noise(self.seed, rows, index, logits.shape[-1])
        return sample_step(logits, noise=noise, **self.sample)

    def step(self) -> None:
        """Feed every slot's last token, draw and record the next (no host syncs)."""
        slots = torch.arange(self.slots, device=self.mask.device)
        # a device tensor, not ``= True``: a Python value is copied from the host, which a
        # CUDA graph cannot capture
        self.mask.index_put_((slots, self.column), self.ones)
        pos = (self.pos0 + self.fed)[:, None].unsqueeze(0).expand(3, -1, -1)
        cache = SlotCache(self.keys, self.values, self.column)
        logits = self.logits(self.tok, pos, cache, self.mask, self.start)
        tok, lp = self._draw(logits, self.row_keys[self.row], self.count)
        live = ~self.done
        dst_row = torch.where(live, self.row, self.row_prompt.shape[0])
        dst_col = torch.where(live, self.count, self.max_new)
        self.out_tokens[dst_row, dst_col] = tok
        self.out_logprobs[dst_row, dst_col] = lp.float()
        ended = torch.isin(tok, self.stop) | (self.count + 1 >= self.limit)
        self.done |= ended
        step = live.long()
        self.tok.copy_(torch.where(live, tok, self.tok))
        self.fed += step
        self.column += step
        self.count += step

    # ------------------------------------------------------------------------- host bookkeeping
    def harvest(self) -> int:
        """Free the slots whose rows ended (their lengths kept); returns the slots still live."""
        done = self.done.tolist()
        count = self.count.tolist()
        live = 0
        for s, r in enumerate(self.held):
            if r is None:
                continue
            if done[s]:
                self.lengths[r] = count[s]
                self.held[s] = None
            else:
                live += 1
        return live

    def partial_lengths(self) -> list[int]:
        """Each row's tokens so far: its length if it ended, its slot's count if it runs, its
        earlier tokens if it never started."""
        out = [int(n) for n in self.first_index.tolist()]
        count = self.count.tolist()
        for s, r in enumerate(self.held):
            if r is not None:
                out[r] = count[s]
        for r, n in enumerate(self.lengths):
            if n is not None:
                out[r] = n
        return out

    def repack(self, live: int) -> bool:
        """Move the live slots to the front and decode only the first ``size`` (the next power
        of two >= ``live``) when that halves the batch at least. True when it re-packed.

        In place: each buffer's live rows are gathered (a copy of the live rows only, one
        tensor at a time) into its first rows, and the decoder keeps views of those; nothing
        the size of the batch is allocated, so the tail of a step never needs more memory than
        its start (a re-pack into new buffers ran out of memory at 256 rows on one H200).
        """
        size = 1 << max(0, math.ceil(math.log2(max(live, 1))))
        if size > self.slots // 2:
            return False
        keep = [s for s, r in enumerate(self.held) if r is not None]
        idx = torch.tensor(keep, device=self.mask.device)
        n = len(keep)
        for buffers in (self.keys, self.values):
            for i, buf in enumerate(buffers):
                buf[:n] = buf[idx]
                buffers[i] = buf[:size]
        for name in self.STATE:
            tensor = getattr(self, name)
            tensor[:n] = tensor[idx]
            tensor[n:size] = self.IDLE.get(name, tensor[n:size])
            setattr(self, name, tensor[:size])
        self.held = [self.held[s] for s in keep] + [None] * (size - n)
        self.graph = None  # a new graph for the smaller batch
        return True


@torch.no_grad()
def decode_continuous(
    thinker: OmniThinker,
    prefilled: Prefilled,
    *,
    repeats: int,
    limits: torch.Tensor,
    max_new_tokens: int,
    sample: dict[str, Any],
    stop: torch.Tensor,
    pad_token_id: int,
    cuda_graph: bool,
    max_slots: int,
    generator: torch.Generator | None = None,
    plan: RowPlan | None = None,
    memory_utilization: float = 0.85,
) -> GenerationResult:
    """Decode ``repeats`` samples of every prefilled prompt through refilled slots (or the rows
    of ``plan``: partial rollouts, see :class:`RowPlan`)."""
    device = prefilled.mask.device
    prompts = prefilled.mask.shape[0]
    if plan is None:
        row_prompt = torch.arange(prompts, device=device).repeat_interleave(repeats)
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
    else:  # the rows' own keys: no per-call seed, so a resumed row draws what it would have
        row_prompt = torch.tensor(plan.prefill_row, dtype=torch.long, device=device)
        seed = 0
    rows = row_prompt.shape[0]
    slots = plan_slots(prefilled, rows, max_new_tokens, device, max_slots, memory_utilization)
    decoder = ContinuousDecoder(
        thinker, prefilled, row_prompt, limits, max_new_tokens, slots, sample, seed, stop, plan
    )
    decoder.refill()
    while True:
        live = decoder.harvest()
        if plan is not None and _has_its_groups(plan, decoder.lengths):
            break  # the step has its groups: the rest stay as they stand
        if decoder.pending():
            decoder.refill()
            live = decoder.slots - decoder.held.count(None)
        elif live and decoder.repack(live):
            log.debug("re-packed %d live rows into %d slots", live, decoder.slots)
        if not live:
            break
        if cuda_graph and decoder.graph is None:
            decoder.capture()  # its warm-up steps are real steps
        for _ in range(STOP_CHECK_EVERY):
            decoder.replay()
    ended = [n is not None for n in decoder.lengths]
    lengths = torch.tensor(decoder.partial_lengths(), dtype=torch.long)
    tokens = decoder.out_tokens[:rows, :max_new_tokens].cpu()
    logprobs = decoder.out_logprobs[:rows, :max_new_tokens].float().cpu()
    del decoder
    valid = torch.arange(max_new_tokens)[None] < lengths[:, None]
    last = tokens.gather(1, (lengths - 1).clamp(min=0)[:, None])[:, 0]
    stopped = torch.isin(last, stop.cpu())
    reasons = ["stop" if bool(s) else "length" for s in stopped]
    return GenerationResult(
        tokens=torch.where(valid, tokens, torch.full_like(tokens, pad_token_id)),
        logprobs=torch.where(valid, logprobs, torch.zeros_like(logprobs)),
        lengths=lengths,
        finish_reasons=[r if e else "partial" for r, e in zip(reasons, ended, strict=True)],
    )


def _has_its_groups(plan: RowPlan, lengths: list[int | None]) -> bool:
    """Whether ``plan.need_groups`` groups have every row ended (never, without a need)."""
    if plan.need_groups is None:
        return False
    open_groups = {g for g, n in zip(plan.group, lengths, strict=True) if n is None}
    return len(set(plan.group) - open_groups) >= plan.need_groups


def prefill_all(
    thinker: OmniThinker, input_ids: torch.Tensor, attention_mask: torch.Tensor, **media: Any
) -> Prefilled:
    """One prefill forward over every (left-padded) prompt; its cache kept as the slots' source."""
    logits, cache = prefill_forward(thinker, input_ids, attention_mask, **media)
    layer_kv = layer_tensors(cache)
    deltas = thinker.rope_deltas.to(input_ids.device).reshape(-1)
    valid = attention_mask.long().sum(-1)
    return Prefilled(
        keys=[k for k, _ in layer_kv],
        values=[v for _, v in layer_kv],
        mask=attention_mask.bool(),
        pos0=(valid + deltas).long(),  # rope deltas are whole numbers (float in some releases)
        start=(attention_mask.shape[1] - valid).to(torch.int32),
        logits=logits.float(),
    )
