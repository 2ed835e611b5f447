"""Typed /generate results, parsed strictly.

sglang-omni returns no ``output_ids``: completion ids exist only as the second element of each
``[logprob, token_id]`` pair, one pair per sampled token including the final EOS/stop token. A
plain-sglang server would send 3-element pairs; that is refused here rather than misread.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import ResponseContractError

FINISH_TYPES = frozenset({"stop", "length", "abort"})


@dataclass(frozen=True)
class GenerateResult:
    """One sampled completion.

    ``weight_versions`` lists the weight version of every segment when a sample was resumed
    after an abort or truncation (the last entry equals ``weight_version``).
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # stop | length | abort
    prompt_tokens: int
    completion_tokens: int
    weight_version: str | None
    text: str = ""
    cached_tokens: int = 0
    metadata: dict[str, Any] | None = None
    weight_versions: tuple[str | None, ...] = field(default=())
    attempts: int = 1

    def __post_init__(self) -> None:
        if not self.weight_versions:
            object.__setattr__(self, "weight_versions", (self.weight_version,))


def _fail(route: str, message: str, body: Any = None) -> ResponseContractError:
    return ResponseContractError(f"{route}: {message}", route=route, status_code=200, detail=body)


def parse_generate_response(
    body: Any, *, route: str = "/generate", attempts: int = 1
) -> GenerateResult:
    """Validate a 200 body against the contract and return the typed result."""
    if not isinstance(body, Mapping) or not isinstance(body.get("meta_info"), Mapping):
        raise _fail(route, "response has no meta_info object", body)
    meta = body["meta_info"]
    finish = meta.get("finish_reason")
    if not isinstance(finish, Mapping) or finish.get("type") not in FINISH_TYPES:
        raise _fail(
            route,
            f"meta_info.finish_reason: expected {{type: one of {sorted(FINISH_TYPES)}, length}}, got {finish!r}",
        )
    pairs = meta.get("output_token_logprobs")
    if not isinstance(pairs, list):
        raise _fail(
            route,
            f"meta_info.output_token_logprobs: expected a list (return_logprob=true was sent), got {type(pairs).__name__}",
        )
    completion_tokens = meta.get("completion_tokens")
    if not isinstance(completion_tokens, int) or completion_tokens != len(pairs):
        raise _fail(
            route,
            f"meta_info.completion_tokens={completion_tokens!r} but {len(pairs)} logprob pairs",
        )
    token_ids: list[int] = []
    logprobs: list[float] = []
    for i, pair in enumerate(pairs):
        if not isinstance(pair, list) or len(pair) != 2:
            raise _fail(
                route,
                f"output_token_logprobs[{i}]: expected a 2-element [logprob, token_id] pair (sglang-omni), got {pair!r}; is this a plain sglang server?",
            )
        lp, tok = pair
        if not isinstance(tok, int) or isinstance(tok, bool) or tok < 0:
            raise _fail(route, f"output_token_logprobs[{i}][1]: expected a token id, got {tok!r}")
        if not isinstance(lp, int | float) or isinstance(lp, bool) or math.isnan(lp) or lp > 1e-4:
            raise _fail(
                route, f"output_token_logprobs[{i}][0]: expected a logprob <= 0, got {lp!r}"
            )
        token_ids.append(tok)
        logprobs.append(float(lp))
    prompt_tokens = meta.get("prompt_tokens")
    if not isinstance(prompt_tokens, int):
        raise _fail(route, f"meta_info.prompt_tokens: expected an int, got {prompt_tokens!r}")
    return GenerateResult(
        token_ids=token_ids,
        logprobs=logprobs,
        finish_reason=finish["type"],
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        weight_version=meta.get("weight_version"),
        text=body.get("text") or "",
        cached_tokens=int(meta.get("cached_tokens") or 0),
        metadata=meta.get("request_metadata"),
        attempts=attempts,
    )


def concat_results(previous: GenerateResult, continuation: GenerateResult) -> GenerateResult:
    """A resumed sample: the original prompt, both segments' tokens and logprobs in order."""
    return GenerateResult(
        token_ids=previous.token_ids + continuation.token_ids,
        logprobs=previous.logprobs + continuation.logprobs,
        finish_reason=continuation.finish_reason,
        prompt_tokens=previous.prompt_tokens,
        completion_tokens=previous.completion_tokens + continuation.completion_tokens,
        weight_version=continuation.weight_version,
        text=previous.text + continuation.text,
        cached_tokens=previous.cached_tokens + continuation.cached_tokens,
        metadata=continuation.metadata,
        weight_versions=previous.weight_versions + continuation.weight_versions,
        attempts=previous.attempts + continuation.attempts,
    )
