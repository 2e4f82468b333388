"""Small loopback clients for the server tests: raw HTTP/1.1 over a socket, and a paced stream.

The raw client exists to show what the server does *before* a body arrives
(it sends the headers and waits), which no HTTP library lets one control.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import openai


def connect(url: str, timeout_s: float = 30.0) -> socket.socket:
    parts = urlsplit(url)
    return socket.create_connection((parts.hostname, parts.port), timeout=timeout_s)


def head(method: str, path: str, headers: dict[str, str]) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One response: status, headers (lower-case names), body (by Content-Length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before a response: {data!r}")
        data += chunk
    top, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = top.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(status_line.split()[1]), headers, body


def closed_by_server(sock: socket.socket) -> bool:
    """True once the server has closed (EOF or reset); waits up to the socket's timeout."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


class PacedStream(threading.Thread):
    """Streams one long completion after another and notes when each chunk arrives.

    ``mean_gap(t0, t1)`` is the stream's pace: the mean time between two
    chunks of the same stream, over chunks that arrived between t0 and t1
    (each stream's first chunk, its time to first token, is left out).
    """

    def __init__(self, url: str, key: str, model: str, max_tokens: int = 400) -> None:
        super().__init__(daemon=True)
        self.client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)
        self.model, self.max_tokens = model, max_tokens
        self.gaps: list[tuple[float, float]] = []  # (arrival, time since the previous chunk)
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                stream = self.client.completions.create(
                    model=self.model,
                    prompt=[5, 6, 7, 8],
                    max_tokens=self.max_tokens,
                    temperature=0,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                previous = None
                for _ in stream:
                    now = time.perf_counter()
                    if previous is not None:
                        self.gaps.append((now, now - previous))
                    previous = now
                    if self.stop.is_set():
                        stream.close()
                        break
        except BaseException as exc:  # reported by the test, not lost in the thread
            self.error = exc

    def mean_gap(self, t0: float, t1: float) -> float:
        gaps = [g for t, g in self.gaps if t0 <= t <= t1]
        assert len(gaps) >= 20, f"only {len(gaps)} chunks between the marks"
        return sum(gaps) / len(gaps)


class HealthProbe(threading.Thread):
    """GET /health every 50 ms; the latencies, with when each was measured."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.stop, self.latencies = url, threading.Event(), []

    def run(self) -> None:
        with httpx.Client(timeout=30) as http:
            while not self.stop.is_set():
                t0 = time.perf_counter()
                assert http.get(self.url + "/health").status_code == 200
                self.latencies.append((t0, time.perf_counter() - t0))
                time.sleep(0.05)


def long_context_model_dir(tmp_path_factory) -> Path:
    """The tiny model given 16k positions: requests that outlast whatever a test does meanwhile.

    (At the tiny model's 512 positions a whole request takes under a second on a fast machine.)"""
    from cbcore.testing.tiny_tokenizer import save_tiny_model_dir

    path = save_tiny_model_dir(tmp_path_factory.mktemp("cb-tiny-long"), "llama")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 16384}))
    return path
