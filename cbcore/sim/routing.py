"""N simulated replicas behind a router plugin: the same router class `cb serve --replicas` runs.

A router reads each replica's load the way it does behind Ray Serve: an
``EngineLoad`` snapshot refreshed every ``load_interval_s`` (here of virtual
time, so a stale report herds requests exactly as it would live) and its
own exact count of requests in flight per replica.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from cbcore.bench.workload import BenchRequest
from cbcore.engine_core import EngineCore
from cbcore.scale.router import EngineLoad, ReplicaView, Router, RouteRequest, checked_choice, engine_load


def replica_ids(n: int) -> list[str]:
    """Ids that sort in index order (routers see replicas sorted by id)."""
    width = len(str(max(n - 1, 0)))
    return [f"replica-{i:0{width}d}" for i in range(n)]


class RouterPlacement:
    """The driver's placement (:class:`cbcore.bench.driver.Placement`) by a router plugin."""

    def __init__(self, router: Router, n: int, load_interval_s: float = 0.5) -> None:
        if load_interval_s <= 0:
            raise ValueError(f"load_interval_s must be > 0, got {load_interval_s}")
        self.router = router
        self.ids = replica_ids(n)
        self.load_interval_s = load_interval_s
        self.in_flight = [0] * n
        self.placed = [0] * n
        self._loads: list[EngineLoad] | None = None
        self._loads_at = -float("inf")

    def place(self, request: BenchRequest, prompt: Seq[int], engines: Seq[EngineCore]) -> int:
        now = request.arrival_s
        if now - self._loads_at >= self.load_interval_s:
            self._loads = [engine_load(e) for e in engines]
            self._loads_at = now
        age = now - self._loads_at
        assert self._loads is not None
        views = [
            ReplicaView(rid, load, age, flying)
            for rid, load, flying in zip(self.ids, self._loads, self.in_flight, strict=True)
        ]
        req = RouteRequest(
            request.request_id,
            tuple(prompt),
            request.priority,
            request.client_id,
            request.max_new_tokens,
            request.deadline_s,
            request.attrs,
        )
        index = self.ids.index(checked_choice(self.router, req, views))
        self.in_flight[index] += 1
        self.placed[index] += 1
        self.router.on_routed(req, self.ids[index])
        return index

    def done(self, request_id: str, replica: int) -> None:
        self.in_flight[replica] = max(0, self.in_flight[replica] - 1)
        self.router.on_done(request_id, self.ids[replica])
