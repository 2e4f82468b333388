"""The request guard as ASGI middleware, called directly: what it refuses, with which status, before the app.

Each case sends one scripted request through :class:`RequestGuard` in front of an
app that records whether it was reached; the statuses are the documented ones
(module docstring of ``cbcore.serve.guard``).
"""

from __future__ import annotations

import asyncio
import json

import pytest

from cbcore.serve.guard import RequestGuard, default_body_limit
from cbcore.serve.nesting import MAX_JSON_DEPTH

KEY = "secret"


def call(body: bytes | list[bytes] | None, *, headers: dict[bytes, bytes] | None = None,
         path: str = "/v1/completions", max_body_bytes: int = 1024, body_timeout_s: float = 5.0,
         protect_metrics: bool = False, every_s: float = 0.0) -> tuple[int | None, bool, dict | None]:
    """(status sent, whether the app was reached, the error body); ``body`` None: it never arrives; a
    list: its chunks, each ``every_s`` after the one before."""
    reached = []
    chunks = [body] if isinstance(body, bytes) else list(body or [])

    async def app(scope, receive, send):
        reached.append(await receive())
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    sent: list[dict] = []

    async def receive():
        if body is None:
            await asyncio.sleep(3600)
        await asyncio.sleep(every_s)
        return {"type": "http.request", "body": chunks.pop(0), "more_body": bool(chunks)}

    async def send(message):
        sent.append(message)

    guard = RequestGuard(app, api_key=KEY, protect_metrics=protect_metrics, max_body_bytes=max_body_bytes,
                         body_timeout_s=body_timeout_s)
    scope = {"type": "http", "path": path, "headers": list((headers or {}).items())}
    asyncio.run(asyncio.wait_for(guard(scope, receive, send), 10))
    status = sent[0]["status"] if sent else None
    error = json.loads(sent[1]["body"]) if status != 200 and len(sent) > 1 else None
    return status, bool(reached), error


AUTH = {b"authorization": f"Bearer {KEY}".encode()}


def test_the_key_is_needed_and_enough() -> None:
    assert call(b"{}", headers=AUTH)[:2] == (200, True)
    assert call(b"{}", headers={b"authorization": b"Bearer wrong"})[:2] == (401, False)
    assert call(b"{}")[:2] == (401, False)


def test_a_content_length_that_is_not_a_number_is_a_bad_request() -> None:
    status, reached, error = call(b"{}", headers={**AUTH, b"content-length": b"12x"})
    assert (status, reached) == (400, False) and "is not a number" in error["error"]["message"]


def test_a_body_at_the_limit_passes_and_one_byte_more_is_413_unread_by_the_app() -> None:
    assert call(b"x" * 1024, headers={**AUTH, b"content-type": b"text/plain"})[:2] == (200, True)
    assert call(b"x" * 1025, headers={**AUTH, b"content-type": b"text/plain"})[:2] == (413, False)
    assert call(b"x", headers={**AUTH, b"content-length": b"1025"})[:2] == (413, False)


def test_json_nested_deeper_than_the_limit_is_refused_and_at_the_limit_passes() -> None:
    at = b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH
    deeper = b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1)
    assert call(at, headers=AUTH)[:2] == (200, True)
    status, reached, error = call(deeper, headers=AUTH)
    assert (status, reached) == (400, False) and "JSON nested deeper than" in error["error"]["message"]


def test_a_body_that_does_not_arrive_in_time_is_408() -> None:
    status, reached, error = call(None, headers=AUTH, body_timeout_s=0.05)
    assert (status, reached) == (408, False) and "did not arrive within 0.05 s" in error["error"]["message"]


@pytest.mark.parametrize(("context", "limit"), [(1, 1 << 20), (32768, 1 << 20), (32769, 32 * 32769)])
def test_the_default_body_limit_is_a_mebibyte_or_32_bytes_a_token_of_context(context: int, limit: int) -> None:
    assert default_body_limit(context) == limit


@pytest.mark.parametrize("path", ["/v1", "/v1/models", "/reset_prefix_cache"])
def test_the_api_and_the_cache_reset_need_the_key(path: str) -> None:
    assert call(b"{}", path=path)[:2] == (401, False)
    assert call(b"{}", path=path, headers=AUTH)[:2] == (200, True)


@pytest.mark.parametrize("path", ["/health", "/metrics", "/", "/v1x", "/docs"])
def test_health_metrics_and_paths_outside_the_api_need_no_key(path: str) -> None:
    assert call(b"{}", path=path)[:2] == (200, True)


def test_protect_metrics_puts_health_and_metrics_behind_the_key_and_nothing_else() -> None:
    for path in ("/health", "/metrics"):
        assert call(b"{}", path=path, protect_metrics=True)[:2] == (401, False)
        assert call(b"{}", path=path, protect_metrics=True, headers=AUTH)[:2] == (200, True)
    assert call(b"{}", path="/docs", protect_metrics=True)[:2] == (200, True)


def test_the_body_timeout_bounds_the_whole_body_not_each_chunk() -> None:
    """Chunks 30 ms apart, within 50 ms each, but the whole body not within 50 ms: 408."""
    chunks = [b"[", b"1", b",", b"2", b"]"]
    status, reached, error = call(chunks, headers=AUTH, body_timeout_s=0.05, every_s=0.03)
    assert (status, reached) == (408, False) and "did not arrive within 0.05 s" in error["error"]["message"]
    assert call(chunks, headers=AUTH, body_timeout_s=5.0, every_s=0.001)[:2] == (200, True)


def test_the_guards_settings_are_taken_only_by_name() -> None:
    """Four settings of which two are numbers: passed in order, a swap would go unnoticed."""
    with pytest.raises(TypeError):
        RequestGuard(None, KEY, False, 1024, 5.0)
