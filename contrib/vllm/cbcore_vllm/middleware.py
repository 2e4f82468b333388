"""``--middleware cbcore_vllm.RequestCheck``: a bad ``vllm_xargs`` field is a 400 naming it, before vLLM's engine.

The scheduler checks a request's ``client_id``, ``deadline_s`` and ``attrs``
when the request arrives and refuses a bad one alone, through vLLM's
per-request error path. From vLLM 0.33.0 that path carries the reason to the
client (HTTP 400 with it); vLLM 0.32.0's carries none, and its API server
turns the bare error into HTTP 500 "Internal server error". This ASGI
middleware in front of vLLM's API applies the same check (the same function,
:func:`cbcore_vllm.fields.check_xargs`) to the JSON body of a completion or
chat request, and answers a bad field with 400 in OpenAI's error format, so
every version answers alike. Requests without ``vllm_xargs`` pass untouched
(their bodies are not parsed here).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from cbcore_vllm.fields import RequestFieldError, check_xargs

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

PATHS = ("/v1/completions", "/v1/chat/completions")


class RequestCheck:
    """Pure ASGI middleware (vLLM's ``--middleware`` takes a class and wraps its app with it)."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in PATHS:
            await self.app(scope, receive, send)
            return
        messages: list[Message] = []
        body = bytearray()
        while True:
            message = await receive()
            messages.append(message)
            body += message.get("body", b"")
            if message["type"] != "http.request" or not message.get("more_body", False):
                break
        problem = _problem(bytes(body)) if b"vllm_xargs" in body else None
        if problem is not None:
            await _bad_request(send, problem)
            return

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)


def _problem(body: bytes) -> str | None:
    """What is wrong with the body's ``vllm_xargs`` (the scheduler's own words), or None."""
    try:
        data = json.loads(body)
    except ValueError:
        return None  # not JSON: vLLM's own validation answers
    xargs = data.get("vllm_xargs") if isinstance(data, dict) else None
    if not isinstance(xargs, dict):
        return None
    try:
        check_xargs(xargs)
    except RequestFieldError as exc:
        return str(exc)
    return None


async def _bad_request(send: Send, message: str) -> None:
    payload = json.dumps(
        {"error": {"message": message, "type": "BadRequestError", "param": "vllm_xargs", "code": 400}}
    ).encode()
    await send({"type": "http.response.start", "status": 400,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})  # fmt: skip
    await send({"type": "http.response.body", "body": payload})
