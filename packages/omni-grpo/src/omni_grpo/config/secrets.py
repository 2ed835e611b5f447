"""What must never be printed: values under secret-looking keys, URL passwords, the admin key.

Error messages echo what the user wrote and a run stores its resolved config; both pass through
here so that an admin key or a password in a URL never reaches a terminal, a log or a run dir.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from typing import Any

# A config key whose value must never be printed: the last segment of its dotted path matches.
SECRET_KEY = re.compile(
    r"(?i)(?:^|_)(?:api_?key|key|secret|secrets|password|passwd|pwd|token|auth|credentials?|bearer)$"
)
# The password of a URL's userinfo (``http://user:PASSWORD@host``): masked wherever a URL is shown.
URL_PASSWORD = re.compile(r"(?<=://)([^/@\s:'\"]+):([^/@\s'\"]+)@")


def is_secret_key(name: object) -> bool:
    """``SECRET_KEY`` on the name as snake case: ``apiKey``, ``hf-token`` and ``HF_TOKEN`` count
    as well as ``admin_api_key``."""
    text = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", str(name)).replace("-", "_")
    return bool(SECRET_KEY.search(text))


def mask_url_passwords(text: str) -> str:
    """``text`` with the password of every URL's userinfo masked."""
    return URL_PASSWORD.sub(r"\1:<redacted>@", text)


def _secret_values(raw: Any, secret: bool = False) -> Iterator[str]:
    """Every scalar stored under a secret-looking key anywhere in ``raw`` (also in lists), as
    text: what an error message must never contain, wherever the key was (mis)placed."""
    if isinstance(raw, dict):
        for key, value in raw.items():
            yield from _secret_values(value, secret or is_secret_key(key))
    elif isinstance(raw, list | tuple):
        for value in raw:
            yield from _secret_values(value, secret)
    elif secret and raw is not None and str(raw).strip():
        yield str(raw)


def redact(text: str, raw: Any = None) -> str:
    """``text`` with every secret value of ``raw`` (and of the admin-key environment) masked."""
    secrets = set(_secret_values(raw))
    env_key = os.environ.get("SGLANG_OMNI_ADMIN_KEY")
    if env_key:
        secrets.add(env_key)
    for value in sorted(secrets, key=len, reverse=True):
        text = text.replace(value, "<redacted>")
        text = text.replace(repr(value), "'<redacted>'")
    return mask_url_passwords(text)


def looks_secret(loc: tuple[Any, ...], value: Any) -> bool:
    """Whether an error's value may not be echoed: its key looks secret, it holds a value under
    such a key, or it is a mapping or list (which may hide one however its keys are spelled)."""
    if any(is_secret_key(part) for part in loc):
        return True
    return any(True for _ in _secret_values(value, False)) or isinstance(value, dict | list)
