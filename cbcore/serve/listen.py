"""The listening address, bound before the model loads.

A model takes seconds to minutes to load; an address that cannot be served
(``--host 256.1.1.1``, a port in use, an address of another machine) should
fail before that, not after. :func:`bind` resolves the host and binds a
socket to each of its addresses, as asyncio would (``localhost`` may be
both 127.0.0.1 and ::1), and listens on it at once: a port is only taken
for sure once listened on (two sockets with ``SO_REUSEADDR`` may both bind
one port while neither listens). The server later serves exactly these
sockets; a client that connects while the model loads waits in the backlog
and is answered once the server is up.
"""

from __future__ import annotations

import ipaddress
import re
import socket


class BindError(OSError):
    """The address cannot be served; the message says which and why."""


BACKLOG = 2048  # uvicorn's


def bind(host: str, port: int) -> list[socket.socket]:
    """Sockets listening on every address of ``host`` at ``port`` (0: one free port, the same for each)."""
    if re.fullmatch(r"[0-9.]+", host):  # dotted numbers are an IPv4 address or nothing (never a name)
        try:
            ipaddress.IPv4Address(host)
        except ValueError as exc:
            raise BindError(f"--host {host}: not an IPv4 address ({exc})") from None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise BindError(f"--host {host}: cannot resolve it ({exc.strerror})") from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):  # each address once, in order
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart need not wait out TIME_WAIT
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # the IPv4 socket is its own
            if port == 0 and len(sockets) > 1:
                address = (address[0], sockets[0].getsockname()[1], *address[2:])
            try:
                sock.bind(address)
                sock.listen(BACKLOG)
            except OSError as exc:
                raise BindError(f"cannot listen on {_show(address)}: {exc.strerror or exc}") from None
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def _show(address: tuple) -> str:
    host, port = address[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
