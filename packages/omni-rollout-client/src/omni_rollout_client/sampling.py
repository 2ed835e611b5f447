"""Sampling parameters filtered to what sglang-omni 0.1.9's ``RolloutSamplingParams`` accepts.

The server forbids extra keys (422 for every request), treats an omitted ``temperature`` as greedy
(not 1.0), and answers some out-of-range values with a 500 that a retry loop would repeat forever.
So the filter here is strict and local: known detokenisation-only keys that trainer code carries are
dropped (the server's behaviour for them is fixed anyway), everything else unknown raises before
anything is sent, and the 500-producing ranges are refused with a named error.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from .errors import ClientValidationError

# Keys the server accepts, with the local check that stands in for its pydantic/runtime checks.
ACCEPTED_KEYS: frozenset[str] = frozenset(
    {
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "stop",
        "stop_token_ids",
        "seed",
        "max_new_tokens",
        "max_tokens",
    }
)

# Detokenisation-only keys plain-sglang clients always send. sglang-omni's behaviour is fixed
# (text decoded with skip_special_tokens=True, stop/EOS token kept in ids and logprobs), so
# dropping them changes nothing the trainer consumes.
DROPPED_KEYS: frozenset[str] = frozenset(
    {"skip_special_tokens", "no_stop_trim", "spaces_between_special_tokens"}
)

# repetition_penalty modifies logits before the sampler, so any value but 1.0 makes rollout
# logprobs incomparable with the trainer's recompute.
PINNED_VALUES: dict[str, float] = {"repetition_penalty": 1.0}

# sglang-omni 0.1.9 rejects more than this many stop strings with a 400.
MAX_STOP_STRINGS = 32

DEFAULT_TEMPERATURE = 1.0


def _require(cond: bool, key: str, expected: str, got: Any) -> None:
    if not cond:
        raise ClientValidationError(f"sampling_params[{key!r}]: expected {expected}, got {got!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def filter_sampling_params(params: Mapping[str, Any] | None) -> dict[str, Any]:
    """Return the ``sampling_params`` object to send, or raise naming the offending key.

    ``temperature`` is always present in the result (default 1.0, the documented default, since
    the server would otherwise sample greedily), ``repetition_penalty`` is always 1.0, and
    ``max_tokens`` is folded into ``max_new_tokens``.
    """
    params = dict(params or {})
    unknown = sorted(set(params) - ACCEPTED_KEYS - DROPPED_KEYS)
    if unknown:
        raise ClientValidationError(
            f"sampling_params has keys sglang-omni rejects with 422: {unknown}; "
            f"accepted: {sorted(ACCEPTED_KEYS)} (dropped silently: {sorted(DROPPED_KEYS)})"
        )
    out: dict[str, Any] = {}
    for key in ACCEPTED_KEYS & params.keys():
        if params[key] is not None:
            out[key] = params[key]

    temperature = out.get("temperature", DEFAULT_TEMPERATURE)
    _require(
        _is_number(temperature) and temperature >= 0,
        "temperature",
        "a finite number >= 0",
        temperature,
    )
    out["temperature"] = float(temperature)

    for key, pinned in PINNED_VALUES.items():
        value = out.get(key, pinned)
        _require(
            _is_number(value) and float(value) == pinned,
            key,
            f"{pinned} (pinned: it changes logprobs)",
            value,
        )
        out[key] = pinned

    if "top_p" in out:
        _require(
            _is_number(out["top_p"]) and 0 < out["top_p"] <= 1,
            "top_p",
            "0 < top_p <= 1",
            out["top_p"],
        )
    if "min_p" in out:
        _require(
            _is_number(out["min_p"]) and 0 <= out["min_p"] <= 1,
            "min_p",
            "0 <= min_p <= 1",
            out["min_p"],
        )
    if "top_k" in out:
        # 0 or below -1 is a 500 on the server (retried forever by a naive client).
        _require(
            _is_int(out["top_k"]) and (out["top_k"] == -1 or out["top_k"] >= 1),
            "top_k",
            "-1 or an int >= 1",
            out["top_k"],
        )
    if "seed" in out:
        _require(_is_int(out["seed"]), "seed", "an int", out["seed"])
    if "max_tokens" in out:
        max_tokens = out.pop("max_tokens")
        out.setdefault("max_new_tokens", max_tokens)
    if "max_new_tokens" in out:
        _require(
            _is_int(out["max_new_tokens"]) and out["max_new_tokens"] >= 1,
            "max_new_tokens",
            "an int >= 1",
            out["max_new_tokens"],
        )
    if "stop" in out:
        stop = [out["stop"]] if isinstance(out["stop"], str) else out["stop"]
        _require(
            isinstance(stop, list | tuple) and all(isinstance(s, str) for s in stop),
            "stop",
            "a str or a list of str",
            out["stop"],
        )
        _require(
            len(stop) <= MAX_STOP_STRINGS,
            "stop",
            f"at most {MAX_STOP_STRINGS} strings",
            f"{len(stop)} strings",
        )
        out["stop"] = list(stop)
    if "stop_token_ids" in out:
        ids = out["stop_token_ids"]
        _require(
            isinstance(ids, list | tuple) and all(_is_int(i) and i >= 0 for i in ids),
            "stop_token_ids",
            "a list of non-negative ints",
            ids,
        )
        out["stop_token_ids"] = [int(i) for i in ids]
    return out
