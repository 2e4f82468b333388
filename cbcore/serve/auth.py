"""API key check: ``Authorization: Bearer KEY``, compared in constant time.

It is applied by :class:`cbcore.serve.guard.RequestGuard`, before the body is read.
"""

from __future__ import annotations

import hmac


def key_matches(header: str | None, key: str) -> bool:
    scheme, _, token = (header or "").partition(" ")
    # compare_digest on bytes: its time does not depend on where the first difference is.
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())
