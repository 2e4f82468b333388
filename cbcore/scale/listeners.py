"""Where the replicas' own network listeners bind, and which hosts `cb serve --replicas` accepts.

Ray Serve 2.60 starts an inter-deployment gRPC server in every replica
(ingress and engines alike) on ``[::]:0``: all interfaces, whatever address
the HTTP proxy was given, and whatever address Ray's own services use. Its
callers reach it at the replica's node address (``node_ip:port``), so
binding it there instead changes nothing for them and, on a local instance
(node address 127.0.0.1), keeps it on loopback. Serve has no option for this
address, so :func:`bind_replica_grpc_to_node_ip` wraps the one function that
binds it, in the replica's own process, before Serve calls it (Serve starts
the server after the deployment's constructor has run).

Ray's other services follow the node address too (loopback for a local
instance). On a cluster they must listen where the other nodes reach them,
which is not loopback; and the HTTP proxy on a non-loopback host is Ray's
own uvicorn, without cb serve's header timeout. Both are exposures a user
has to accept knowingly (:func:`exposure`; docs/scale-out.md).
"""

from __future__ import annotations

import ipaddress
from typing import Any

ALL_INTERFACES = "[::]:0"
_PATCHED = "_cbcore_binds_node_ip"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bind_replica_grpc_to_node_ip() -> str:
    """Make this replica's inter-deployment gRPC server bind the node address; returns that address."""
    import ray
    from ray.serve._private import replica as serve_replica

    original: Any = getattr(serve_replica, "add_port_to_grpc_server", None)
    if original is None:
        raise RuntimeError(
            "this Ray Serve no longer binds its replica gRPC server through add_port_to_grpc_server; "
            "cbcore cannot keep it off other interfaces (cbcore targets Ray 2.60)"
        )
    ip = ray.util.get_node_ip_address()
    if getattr(original, _PATCHED, False):
        return ip
    host = f"[{ip}]" if ":" in ip else ip

    def bind(server: Any, address: str) -> int:
        return original(server, f"{host}:0" if address == ALL_INTERFACES else address)

    setattr(bind, _PATCHED, True)
    serve_replica.add_port_to_grpc_server = bind
    return ip


def exposure(host: str, ray_address: str | None) -> str | None:
    """What listens beyond loopback with these settings, or None when everything stays on loopback."""
    reasons = []
    if not is_loopback(host):
        reasons.append(
            f"the HTTP proxy on {host} is Ray Serve's own, without cb serve's header timeout or its "
            "connection handling"
        )
    if ray_address:
        node = ray_address.rsplit(":", 1)[0] if ray_address != "auto" else "auto"
        if not is_loopback(node):
            reasons.append(
                f"on the cluster at {ray_address}, Ray's services and each replica's gRPC server listen on "
                "the nodes' addresses (token authentication, on by default in Ray 2.60, guards them)"
            )
    return "; ".join(reasons) or None
