"""What every request passes before a route sees it: the API key, then the body's size and pace.

This is ASGI middleware rather than a route dependency because FastAPI reads
and parses a route's body before its dependencies run: a key checked there
lets anyone make the server read, hold and parse a body of any size. Here,
in order and before anything else:

1. ``/v1`` and ``/reset_prefix_cache`` (and ``/health``, ``/metrics`` with
   ``protect_metrics``) need the key: 401 from the headers alone, without reading a byte of the body.
2. A ``Content-Length`` beyond ``max_body_bytes``: 413 at once, unread.
3. The body is read with a running count (chunked bodies have no length up
   front): 413 the moment it passes the limit, 408 if it has not all
   arrived within ``body_timeout_s``.
4. A JSON body nested deeper than 64 levels: 400 naming the path
   (:mod:`cbcore.serve.nesting`). Only then does the route parse it.

What a refused client still sends is discarded by the HTTP protocol after
the response (and the connection closed once that takes longer than the
header timeout: :mod:`cbcore.serve.connection`).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from cbcore.serve.auth import key_matches
from cbcore.serve.errors import ApiError
from cbcore.serve.nesting import MAX_JSON_DEPTH, may_nest_deeper, too_deep

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

MIB = 1 << 20


def default_body_limit(context_tokens: int) -> int:
    """1 MiB, or 32 bytes per token of context if more: room for a full context as JSON text or ids."""
    return max(MIB, 32 * context_tokens)


def route_path(scope: Scope) -> str:
    """The path below the application's root (Ray Serve mounts it under its route prefix)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root) : len(root) + 1] in ("", "/"):
        return path[len(root) :] or "/"
    return path


class RequestGuard:
    def __init__(
        self,
        app: App,
        *,
        api_key: str | None,
        protect_metrics: bool,
        max_body_bytes: int,
        body_timeout_s: float,
    ) -> None:
        self.app = app
        self.api_key = api_key
        self.protect_metrics = protect_metrics
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    def _needs_key(self, path: str) -> bool:
        if path == "/v1" or path.startswith("/v1/") or path == "/reset_prefix_cache":
            return True
        return self.protect_metrics and path in ("/health", "/metrics")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope.get("headers", ())}
        if self.api_key is not None and self._needs_key(route_path(scope)):
            header = headers.get(b"authorization", b"").decode("latin-1")
            if not key_matches(header, self.api_key):
                await self._refuse(send, ApiError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'"))
                return
        length = headers.get(b"content-length")
        if length is not None:
            if not length.isdigit():
                await self._refuse(send, ApiError(400, f"Content-Length {length.decode('latin-1')!r} is not a number"))
                return
            if int(length) > self.max_body_bytes:
                await self._refuse(send, self._too_large(f"Content-Length is {int(length)} bytes"))
                return
        body = await self._read_body(receive)
        if isinstance(body, ApiError):
            await self._refuse(send, body)
            return
        if body is None:  # the client left while sending
            return
        if may_nest_deeper(body) and (refusal := await _nesting(body, headers.get(b"content-type"))):
            await self._refuse(send, refusal)
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read_body(self, receive: Receive) -> bytes | ApiError | None:
        parts: list[bytes] = []
        size = 0
        deadline = time.monotonic() + self.body_timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                return ApiError(408, f"the request body did not arrive within {self.body_timeout_s:g} s")
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return self._too_large(f"the body passed {self.max_body_bytes} bytes")
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)

    def _too_large(self, what: str) -> ApiError:
        return ApiError(
            413,
            f"request body too large: {what}; this server takes at most {self.max_body_bytes} bytes "
            "(--max-body-bytes, serve.max_body_bytes)",
        )

    async def _refuse(self, send: Send, error: ApiError) -> None:
        payload = json.dumps(error.body()).encode()
        await send(
            {
                "type": "http.response.start",
                "status": error.status,
                # The rest of the body is not read: closing is cheaper than reading it to throw away.
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(payload)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": payload})


async def _nesting(body: bytes, content_type: bytes | None) -> ApiError | None:
    """A 400 for a JSON body nested too deep, naming where; measured off the event loop (a megabyte of
    brackets is tens of milliseconds to measure, and a walk of its tokens to name the path if too deep)."""
    if not _parsed_as_json(content_type) or (found := await asyncio.to_thread(too_deep, body)) is None:
        return None
    field, path = found
    message = f"{path}: JSON nested deeper than {MAX_JSON_DEPTH} levels (the most this server takes)"
    return ApiError(400, message, field or None)


def _parsed_as_json(content_type: bytes | None) -> bool:
    """Whether the routes will parse the body as JSON: FastAPI does without a type, or with a JSON one."""
    if not content_type:
        return True
    subtype = content_type.split(b";")[0].strip().lower().partition(b"/")[2]
    return subtype == b"json" or subtype.endswith(b"+json")


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body already read, then the client's own messages (a disconnect, while a response streams)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
