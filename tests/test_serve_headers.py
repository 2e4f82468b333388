"""Request heads (request line and headers) are bounded before any key check (cbcore/serve/connection.py).

* Against `cb serve` (httptools): an unauthenticated client sending an
  endless header, then one 64 MB header, is answered 431 / closed while
  ``/health`` keeps answering and an authenticated stream keeps its pace
  (before the bound: ``/health`` took 3.5-5.6 s, and the stream stalled).
* The protocol alone, under uvicorn on a thread, for both of uvicorn's
  parsers (httptools and h11): a head at the limit passes, one byte past it
  is a 431 in the API's error shape, whether the bytes are one header, the
  URL, many headers, or arrive in many reads; a body is not counted; each
  request on a kept-alive or pipelined connection is counted on its own (a
  pipelined one from the read after the one that ends the request before it).
"""

from __future__ import annotations

import json
import select
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from support import SERVE_KEY
from support.serve_client import HealthProbe, PacedStream, closed_by_server, connect, read_response

from cbcore.serve.connection import protocol_with_header_limits

LIMIT = 4096


async def echo_app(scope, receive, send) -> None:
    """200 with how many body bytes it read: enough to show that a request got through whole."""
    if scope["type"] != "http":
        return
    size, more = 0, True
    while more:
        message = await receive()
        size, more = size + len(message.get("body", b"")), message.get("more_body", False)
    body = json.dumps({"body_bytes": size}).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body})


def parsers() -> list:
    from uvicorn.protocols.http.h11_impl import H11Protocol

    found = [pytest.param(H11Protocol, id="h11")]
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        found.append(pytest.param(HttpToolsProtocol, id="httptools"))
    except ImportError:
        pass
    return found


@pytest.fixture(scope="module", params=parsers())
def url(request) -> Iterator[str]:
    config = uvicorn.Config(
        echo_app,
        host="127.0.0.1",
        port=0,
        http=protocol_with_header_limits(5.0, LIMIT, request.param),
        h11_max_incomplete_event_size=LIMIT,
        lifespan="off",
        log_level="critical",
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)  # not the main thread: no signal handlers
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    server.should_exit = True
    thread.join(10)


def request_head(path: str = "/", pad: int = 0, headers: int = 0, body: int = 0) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: x", f"Content-Length: {body}"]
    lines += [f"X-{i}: v" for i in range(headers)]
    head = ("\r\n".join(lines) + "\r\n").encode()
    if pad:
        head += b"X-Pad: " + b"p" * (pad - len(head) - len(b"X-Pad: \r\n\r\n")) + b"\r\n"
    return head + b"\r\n"


def answer(url: str, data: bytes, pieces: int = 1) -> tuple[int, dict]:
    """Send ``data`` in ``pieces`` (each its own read on the server), stopping once an answer is there."""
    with connect(url, timeout_s=10) as sock:
        step = -(-len(data) // pieces)
        for i in range(0, len(data), step):
            sock.sendall(data[i : i + step])
            if pieces > 1 and select.select([sock], [], [], 0.05)[0]:
                break  # answered (and closed) before the rest: sending on would only meet a reset
        status, _, body = read_response(sock)
        return status, json.loads(body)


def test_a_head_at_the_limit_passes_and_one_byte_more_is_431(url):
    at_limit = request_head(pad=LIMIT)
    assert len(at_limit) == LIMIT
    assert answer(url, at_limit) == (200, {"body_bytes": 0})
    status, body = answer(url, request_head(pad=LIMIT + 1))
    assert status == 431 and body["error"]["type"] == "invalid_request_error"
    assert f"more than {LIMIT} bytes" in body["error"]["message"] and "--max-header-bytes" in body["error"]["message"]


@pytest.mark.parametrize(
    "head",
    [
        request_head(path="/" + "u" * LIMIT),  # the URL
        request_head(headers=LIMIT // 8),  # many small headers
        request_head(pad=3 * LIMIT),  # one header, sent below in many reads
    ],
    ids=["url", "many-headers", "one-header"],
)
def test_every_part_of_the_head_counts_however_it_arrives(url, head):
    assert answer(url, head)[0] == 431
    assert answer(url, head, pieces=12)[0] == 431


def test_the_body_is_not_counted_and_each_request_is_counted_on_its_own(url):
    body = b"b" * (4 * LIMIT)
    assert answer(url, request_head(pad=LIMIT - 100, body=len(body)) + body) == (200, {"body_bytes": len(body)})
    with connect(url, timeout_s=10) as sock:  # kept alive: three heads of 3/4 of the limit each pass
        for _ in range(3):
            sock.sendall(request_head(pad=LIMIT * 3 // 4))
            assert read_response(sock)[0] == 200
        sock.sendall(request_head(pad=LIMIT + 1))
        assert read_response(sock)[0] == 431
        assert closed_by_server(sock)
    with connect(url, timeout_s=10) as sock:  # pipelined: the first is served, the second refused
        second = request_head(pad=3 * LIMIT)
        sock.sendall(request_head(pad=LIMIT * 3 // 4) + second[:100])  # counted from the next read
        assert read_response(sock)[0] == 200
        for i in range(100, len(second), 500):
            time.sleep(0.01)
            try:
                sock.sendall(second[i : i + 500])
            except (BrokenPipeError, ConnectionResetError):
                break
        assert read_response(sock)[0] == 431


# -- against `cb serve` -------------------------------------------------------------------------------


def endless_header(url: str, seconds: float) -> str:
    """Send one header without end, as fast as the server takes it; how it ended."""
    sent, t0 = 0, time.perf_counter()
    with connect(url, timeout_s=10) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Pad: ")
        try:
            while time.perf_counter() - t0 < seconds:
                sent += sock.send(b"p" * 65536)
        except (BrokenPipeError, ConnectionResetError):
            return "closed"
    return f"still open after {sent} bytes"


def huge_header(url: str, size: int) -> int | str:
    with connect(url, timeout_s=30) as sock:
        try:
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"p" * size + b"\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            return "closed"
        try:
            return read_response(sock)[0]
        except (ConnectionError, TimeoutError):
            return "closed"


def test_endless_and_huge_headers_stall_neither_health_nor_a_stream(tiny_server):
    models = httpx.get(tiny_server.url + "/v1/models", headers={"Authorization": f"Bearer {SERVE_KEY}"})
    model = models.json()["data"][0]["id"]
    pacer, probe = PacedStream(tiny_server.url, SERVE_KEY, model), HealthProbe(tiny_server.url)
    pacer.start()
    while len(pacer.gaps) < 20 and pacer.is_alive():
        time.sleep(0.05)
    t0 = time.perf_counter()
    time.sleep(1.5)
    t1 = time.perf_counter()  # [t0, t1]: the stream's pace before
    probe.start()
    endless = endless_header(tiny_server.url, seconds=2.0)
    huge = huge_header(tiny_server.url, 64_000_000)
    time.sleep(max(0.0, t1 + 2.0 - time.perf_counter()))
    t2 = time.perf_counter()
    probe.stop.set()
    time.sleep(1.5)
    t3 = time.perf_counter()
    pacer.stop.set()
    probe.join(60)
    pacer.join(60)
    assert pacer.error is None, pacer.error
    worst = max(latency for _, latency in probe.latencies)
    unloaded = pacer.mean_gap(t0, t1) / 2 + pacer.mean_gap(t2, t3) / 2
    loaded = pacer.mean_gap(t1, t2)
    print(f"\n/health slowest {worst * 1e3:.0f} ms; inter-token gap {unloaded * 1e3:.1f} ms, {loaded * 1e3:.1f} ms attacked")
    # Generous bounds: the stall they guard against was seconds long.
    assert len(probe.latencies) >= 5 and worst < 1.0
    assert loaded < 3 * unloaded
    assert endless == "closed" and huge in (431, "closed"), (endless, huge)
