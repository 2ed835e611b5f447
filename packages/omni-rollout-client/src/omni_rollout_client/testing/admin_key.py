"""The admin API key check, one for both fakes: sglang-omni's worker and its router answer a
missing key with the same 401 (and ``WWW-Authenticate: Bearer``) and a wrong one with the same
403, and a client must not be able to tell which of them it reached."""

from __future__ import annotations

import hmac

# (status, detail, headers) of the JSON error an admin request gets instead of an answer
Refusal = tuple[int, str, dict[str, str] | None]


def admin_key_refusal(authorization: str | None, key: str | None) -> Refusal | None:
    """Why a request with this ``Authorization`` header may not use an admin route, or None when
    it may (always, when the server has no key). The key is compared in constant time."""
    if not key:
        return None
    parts = (authorization or "").split(None, 1)
    if len(parts) != 2 or parts[0].lower() != "bearer" or not parts[1]:
        return (
            401,
            "Admin API key required: Authorization: Bearer <key>",
            {"WWW-Authenticate": "Bearer"},
        )
    if not hmac.compare_digest(parts[1].encode(), key.encode()):
        return 403, "Invalid admin API key", None
    return None
