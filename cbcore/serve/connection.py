"""uvicorn's HTTP protocol with bounds on request headers, enforced before any route or key check.

**Time.** uvicorn arms its idle (keep-alive) timer only after a response,
and any byte disarms it, so a connection that sends nothing after
connecting, or sends a request's headers a byte at a time, is held open for
ever. Here a deadline of ``header_timeout_s`` starts when the connection
opens and again with the first byte of each next request (or of the rest of
a refused body, which uvicorn reads and throws away after the response); it
is cancelled when a request's headers are complete. If it passes, the
connection is closed.

**Size.** The httptools parser joins each header's pieces with ``+=``, and
uvicorn the URL's, so a header that arrives in many reads costs time in
the square of its length, all of it on the event loop: an endless header
stalled every other client for seconds, a 64 MB one for 3.5 s. Here the
bytes of a request's head (request line and headers, up to the blank line)
are counted as they arrive, before the parser sees them, whenever the
parser is waiting for a head; past ``max_header_bytes`` the request is
answered 431 and the connection closed, unparsed. A pipelined request whose
head begins in the read that ends the request before it is counted from
the next read (so by at most one read, 256 KiB, more). h11, uvicorn's
parser where httptools is not installed, is given the same bound on its
own buffer, and its refusal is answered 431 too.

The body's own pace and size are the guard's business
(:mod:`cbcore.serve.guard`); an idle connection after a response is closed
by uvicorn's keep-alive timeout.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from cbcore.log import get_logger
from cbcore.serve.errors import ApiError

log = get_logger(__name__)
#: Request line and headers together, by default; 431 past it.
MAX_HEADER_BYTES = 64 * 1024


def base_protocol() -> type[asyncio.Protocol]:
    """The protocol uvicorn would pick (``http="auto"``): httptools when installed, else h11."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        return HttpToolsProtocol
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol

        return H11Protocol


def too_large_response(max_header_bytes: int) -> bytes:
    """The whole 431 answer: the API's error object, and the connection closes."""
    error = ApiError(
        431,
        f"request headers too large: more than {max_header_bytes} bytes "
        "(request line and headers together; --max-header-bytes, serve.max_header_bytes)",
    )
    body = json.dumps(error.body()).encode()
    head = (
        "HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


def protocol_with_header_limits(
    header_timeout_s: float, max_header_bytes: int = MAX_HEADER_BYTES, base: type[asyncio.Protocol] | None = None
) -> type[asyncio.Protocol]:
    base_cls: Any = base or base_protocol()
    refusal = too_large_response(max_header_bytes)

    class HeaderLimitsProtocol(base_cls):  # type: ignore[misc, valid-type]
        """Both uvicorn protocols start a new ``cycle`` exactly when a request's headers are complete."""

        _header_timer: asyncio.TimerHandle | None = None
        _cycle_seen: Any = None
        _in_body = False  # httptools: a request's headers are complete and its body is not
        _head_bytes = 0  # of the head being received, in the reads before this one
        _head_tail = b""  # its last bytes: a blank line may be split between two reads

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._header_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._arm()  # the first byte of the next request, or of a refused body's rest
            if self._awaiting_head() and self._head_too_large(data):
                log.debug("refusing a request head past the limit", max_header_bytes=max_header_bytes)
                self._refuse()
                return
            super().data_received(data)
            if self.cycle is not self._cycle_seen:
                self._cycle_seen = self.cycle
                self._disarm()

        def _awaiting_head(self) -> bool:
            """Whether the next bytes belong to a request's head (or start one), by the parser's state."""
            conn = getattr(self, "conn", None)  # h11's connection; httptools reports through callbacks
            if conn is not None:
                import h11

                return conn.their_state is h11.IDLE
            return not self._in_body

        def _head_too_large(self, data: bytes) -> bool:
            """Count this read's bytes of the head, up to its blank line if it is here; past the limit?"""
            if not self._head_bytes:
                data = data.lstrip(b"\r\n")  # empty lines before a request line are not part of it
                self._head_tail = b""
            window = self._head_tail + data
            ends = [i + len(blank) for blank in (b"\r\n\r\n", b"\n\n") if (i := window.find(blank)) >= 0]
            if ends:
                total = self._head_bytes + min(ends) - len(self._head_tail)
                self._head_bytes, self._head_tail = 0, b""
            else:
                total = self._head_bytes = self._head_bytes + len(data)
                self._head_tail = window[-3:]
            return total > max_header_bytes

        def _refuse(self) -> None:
            if not self.transport.is_closing():
                self.transport.write(refusal)
                self.transport.close()

        def send_400_response(self, msg: str) -> None:
            """h11 refuses a head past its own bound as malformed; answered 431 here, like ours. (Ours comes
            first, but h11 reads a pipelined request's head from its buffer, past this count.)"""
            conn = getattr(self, "conn", None)
            if conn is not None and len(conn.trailing_data[0]) > max_header_bytes:
                self._refuse()
                return
            super().send_400_response(msg)

        # httptools' callbacks (h11 has none of these).
        def on_headers_complete(self) -> None:
            self._in_body = True
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._in_body = False
            super().on_message_complete()

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

    return HeaderLimitsProtocol
