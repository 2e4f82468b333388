"""API key check: ``Authorization: Bearer KEY``, compared in constant time."""

from __future__ import annotations

import hmac

from fastapi import Request

from cbcore.serve.errors import ApiError


def key_matches(header: str | None, key: str) -> bool:
    scheme, _, token = (header or "").partition(" ")
    # compare_digest on bytes: its time does not depend on where the first difference is.
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


async def require_key(request: Request) -> None:
    """A route dependency; a server started without a key lets everything through."""
    key = request.app.state.cb.api_key
    if key is not None and not key_matches(request.headers.get("authorization"), key):
        raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'")
