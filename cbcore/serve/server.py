"""Running the app under uvicorn: the ready line, and a graceful shutdown that exits 0.

On SIGTERM or SIGINT the server stops accepting connections, new requests on
open connections get 503, in-flight requests run on for up to
``serve.shutdown_grace_s``; whatever is still running then ends with a clean
error event (a stream) or a 503 (a plain response), and the process exits 0.

A second SIGINT (Ctrl-C twice) ends what is still running at once, with the
same error event or 503, and the process exits 130 (interrupted) once they
have been told: no task is cancelled mid-response, so nothing is logged but
one line. Should that take longer than :data:`FORCED_EXIT_S` (a request
still sending its body, say), or on a third SIGINT, the process exits 130
without waiting.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from types import FrameType
from typing import Any

import uvicorn

from cbcore.log import get_logger
from cbcore.serve.connection import MAX_HEADER_BYTES, protocol_with_header_limits
from cbcore.serve.engine_loop import EngineLoop

log = get_logger(__name__)
READY = "cb serve: ready on "  # what scripts and tests wait for on stderr
INTERRUPTED = 130  # the exit code of a process that SIGINT ended, as shells report it
FORCED_EXIT_S = 3.0  # after a second SIGINT, the most the requests in flight get to be told


class Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, loop: EngineLoop, grace_s: float, banner: str = "") -> None:
        super().__init__(config)
        self.engine_loop = loop
        self.grace_s = grace_s
        self.banner = banner

    interrupted_twice = False
    forced_exit_timer: threading.Timer | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Unlike uvicorn's own handler, the signal is not re-raised after the shutdown:
        # a drained server exits 0.
        if self.should_exit and sig == signal.SIGINT:
            if self.interrupted_twice:
                _exit_now("interrupted three times")
            self.interrupted_twice = True
            log.warning("interrupted again: ending the requests in flight now")
            self.engine_loop.begin_drain(0.0)  # each gets its error event or 503; uvicorn's shutdown goes on
            why = f"still shutting down {FORCED_EXIT_S:g} s later"
            self.forced_exit_timer = threading.Timer(FORCED_EXIT_S, _exit_now, [why])
            self.forced_exit_timer.daemon = True
            self.forced_exit_timer.start()
            return
        if not self.should_exit:
            log.warning("shutting down", signal=signal.Signals(sig).name, grace_s=self.grace_s)
            self.engine_loop.begin_drain(self.grace_s)
        self.should_exit = True

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.started and self.servers:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            print(f"{READY}http://{host}:{port} {self.banner}".rstrip(), file=sys.stderr, flush=True)


def _exit_now(why: str) -> None:
    print(f"cb serve: {why}: exiting without waiting", file=sys.stderr, flush=True)
    os._exit(INTERRUPTED)


def serve(
    app: Any,
    loop: EngineLoop,
    sockets: list[socket.socket],
    grace_s: float,
    log_level: str,
    banner: str,
    header_timeout_s: float = 10.0,
    max_header_bytes: int = MAX_HEADER_BYTES,
) -> int:
    """Serve on ``sockets`` (bound by :func:`cbcore.serve.listen.bind`) until a signal; returns the exit code
    (0 after a graceful shutdown, 130 after a second SIGINT)."""
    config = uvicorn.Config(
        app,
        http=protocol_with_header_limits(header_timeout_s, max_header_bytes),
        h11_max_incomplete_event_size=max_header_bytes,  # h11 (without httptools) bounds the head itself
        log_level=log_level,
        access_log=log_level in ("debug", "info"),
        timeout_graceful_shutdown=int(grace_s) + 5,  # a backstop: the engine loop aborts at grace_s
        timeout_keep_alive=5,
    )
    server = Server(config, loop, grace_s, banner)
    server.run(sockets=sockets)
    if server.forced_exit_timer is not None:
        server.forced_exit_timer.cancel()
    if server.interrupted_twice:
        print("cb serve: interrupted twice: the requests in flight were ended", file=sys.stderr, flush=True)
        return INTERRUPTED
    return 0 if server.started else 1
