"""uvicorn's HTTP protocol with a header deadline: a connection cannot sit open sending nothing.

uvicorn arms its idle (keep-alive) timer only after a response, and any
byte disarms it, so a connection that sends nothing after connecting, or
sends a request's headers a byte at a time, is held open for ever. Here a
deadline of ``header_timeout_s`` starts when the connection opens and again
with the first byte of each next request (or of the rest of a refused
body, which uvicorn reads and throws away after the response); it is
cancelled when a request's headers are complete. If it passes, the
connection is closed. The body's own pace is the guard's business
(:mod:`cbcore.serve.guard`); an idle connection after a response is closed
by uvicorn's keep-alive timeout.
"""

from __future__ import annotations

import asyncio
from typing import Any

from cbcore.log import get_logger

log = get_logger(__name__)


def base_protocol() -> type[asyncio.Protocol]:
    """The protocol uvicorn would pick (``http="auto"``): httptools when installed, else h11."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        return HttpToolsProtocol
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol

        return H11Protocol


def protocol_with_header_timeout(header_timeout_s: float) -> type[asyncio.Protocol]:
    base: Any = base_protocol()

    class HeaderDeadlineProtocol(base):  # type: ignore[misc, valid-type]
        """Both uvicorn protocols start a new ``cycle`` exactly when a request's headers are complete."""

        _header_timer: asyncio.TimerHandle | None = None
        _cycle_seen: Any = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._header_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._arm()  # the first byte of the next request, or of a refused body's rest
            super().data_received(data)
            if self.cycle is not self._cycle_seen:
                self._cycle_seen = self.cycle
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._header_timer = self.loop.call_later(header_timeout_s, self._expired)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _expired(self) -> None:
            self._header_timer = None
            if self.cycle is not None and not self.cycle.response_complete:
                return  # a request is being served (pipelined bytes arrived meanwhile): not idle
            if not self.transport.is_closing():
                log.debug("closing a connection that sent no complete request headers", timeout_s=header_timeout_s)
                self.transport.close()

    return HeaderDeadlineProtocol
