"""The config's one error type, and the one line a pydantic error becomes.

A user who mistypes a key or a value reads one sentence naming the file and the dotted field path,
never pydantic's multi-line dump, and never the value of a key that may hold a secret.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from omni_grpo.config.secrets import looks_secret, redact


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the file and the dotted field path."""


def format_validation_error(
    err: ValidationError, source: str | None = None, raw: Any = None
) -> str:
    """One line: ``invalid config <source>: rollout.n_samples: Input should be greater than 1
    (got 1); ...``. The value is echoed only when it is a plain scalar of a non-secret key."""
    parts = []
    for e in err.errors():
        # union members add pydantic's own tags ("function-before[...]", "list[...]") to loc
        loc = [p for p in e["loc"] if not any(c in str(p) for c in "[(")]
        path = ".".join(str(p) for p in loc) or "<root>"
        got = e.get("input")
        hide = e["type"] == "missing" or looks_secret(tuple(e["loc"]), got)
        got_s = "" if hide else f" (got {got!r})"
        parts.append(f"{path}: {e['msg']}{got_s}")
    head = f"invalid config {source}" if source else "invalid config"
    return redact(head + ": " + "; ".join(parts), raw)
