"""Deterministic fake token generation for the fake server.

Tokens and logprobs derive from a hash of (prompt ids, tensors digest, seed, temperature), so a
test can predict them; with no seed and temperature > 0 a per-server request counter is mixed in so
the n samples of a GRPO group differ, as on a real sampler. Greedy (temperature 0) ignores both.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class FakeRequest:
    """What a generator sees: the effective request after server-side defaults."""

    request_index: int
    input_ids: list[int]
    temperature: float
    seed: int | None
    max_new_tokens: int
    stop_token_ids: list[int]
    tensors: Mapping[str, np.ndarray] = field(default_factory=dict)
    metadata: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class FakeGeneration:
    """Token ids and their logprobs, EOS/stop token included as the server reports it."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None = None  # None: derived (length if the budget was hit, else stop)


Generator = Callable[[FakeRequest], FakeGeneration]


def _digest(req: FakeRequest) -> bytes:
    h = hashlib.sha256()
    h.update(np.asarray(req.input_ids, dtype=np.int64).tobytes())
    for name in sorted(req.tensors):
        h.update(name.encode())
        h.update(np.ascontiguousarray(req.tensors[name]).tobytes())
    if req.temperature > 0:
        h.update(struct.pack("<d", req.temperature))
        h.update(
            b"seed" + str(req.seed).encode()
            if req.seed is not None
            else b"idx" + str(req.request_index).encode()
        )
    return h.digest()


def make_hash_generator(vocab_size: int, eos_token_id: int, *, max_len: int = 12) -> Generator:
    """The default generator: a hash stream picks a length in [1, max_len] and the tokens; the
    sequence ends with ``eos_token_id`` unless the token budget runs out first."""

    def generate(req: FakeRequest) -> FakeGeneration:
        seed = int.from_bytes(_digest(req)[:8], "little")
        rng = np.random.default_rng(seed)
        natural = int(rng.integers(1, max_len + 1))
        tokens: list[int] = []
        for _ in range(natural - 1):
            tok = int(rng.integers(0, vocab_size))
            if tok == eos_token_id:
                tok = (tok + 1) % vocab_size
            tokens.append(tok)
            if tok in req.stop_token_ids:
                break
        else:
            tokens.append(eos_token_id)
        tokens = tokens[: req.max_new_tokens]
        logprobs = [-float(rng.uniform(0.001, 6.0)) for _ in tokens]
        return FakeGeneration(token_ids=tokens, logprobs=logprobs)

    return generate
