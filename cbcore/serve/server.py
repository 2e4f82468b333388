"""Running the app under uvicorn: the ready line, and a graceful shutdown that exits 0.

On SIGTERM or SIGINT the server stops accepting connections, new requests on
open connections get 503, in-flight requests run on for up to
``serve.shutdown_grace_s``; whatever is still running then ends with a clean
error event (a stream) or a 503 (a plain response), and the process exits 0.
A second SIGINT exits at once.
"""

from __future__ import annotations

import signal
import sys
from types import FrameType
from typing import Any

import uvicorn

from cbcore.log import get_logger
from cbcore.serve.connection import MAX_HEADER_BYTES, protocol_with_header_limits
from cbcore.serve.engine_loop import EngineLoop

log = get_logger(__name__)
READY = "cb serve: ready on "  # what scripts and tests wait for on stderr


class Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, loop: EngineLoop, grace_s: float, banner: str = "") -> None:
        super().__init__(config)
        self.engine_loop = loop
        self.grace_s = grace_s
        self.banner = banner

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Unlike uvicorn's own handler, the signal is not re-raised after the shutdown:
        # a drained server exits 0.
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
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


def serve(
    app: Any,
    loop: EngineLoop,
    host: str,
    port: int,
    grace_s: float,
    log_level: str,
    banner: str,
    header_timeout_s: float = 10.0,
    max_header_bytes: int = MAX_HEADER_BYTES,
) -> int:
    """Serve until a signal; returns the exit code (0 after a graceful shutdown)."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        http=protocol_with_header_limits(header_timeout_s, max_header_bytes),
        h11_max_incomplete_event_size=max_header_bytes,  # h11 (without httptools) bounds the head itself
        log_level=log_level,
        access_log=log_level in ("debug", "info"),
        timeout_graceful_shutdown=int(grace_s) + 5,  # a backstop: the engine loop aborts at grace_s
        timeout_keep_alive=5,
    )
    server = Server(config, loop, grace_s, banner)
    server.run()
    return 0 if server.started else 1
