"""Round robin: each replica in turn, blind to load."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from cbcore.scale.router import ReplicaView, Router, RouteRequest


class RoundRobin(Router):
    """The next replica in id order after the one chosen last.

    The baseline every other router is measured against: it needs no load
    report at all, and it is as good as any when requests cost the same.
    A replica that leaves the set shifts the turn; none is skipped twice.
    """

    name = "round-robin"

    def __init__(self, params=None) -> None:
        super().__init__(params)
        self._last: str | None = None

    def choose(self, request: RouteRequest, replicas: Seq[ReplicaView]) -> str:
        ids = [r.replica_id for r in replicas]
        last = self._last
        nxt = min((i for i in ids if last is not None and i > last), default=min(ids))
        self._last = nxt
        return nxt
