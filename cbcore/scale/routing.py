"""Ray Serve's request router, driven by a cbcore router plugin.

Ray Serve asks a ``RequestRouter`` for ranked replicas for each request; this
one builds a :class:`~cbcore.scale.router.ReplicaView` per replica (its
``engine_load`` from the replica's ``record_routing_stats``, which Ray Serve
polls every ``request_routing_stats_period_s``, and this router's own count of
requests in flight there) and a :class:`~cbcore.scale.router.RouteRequest`
from the submission, and asks the configured plugin. Ray Serve then sends the
request to the first ranked replica that accepts it, and drops a dead replica
from the candidates. A plugin that raises fails that request with its error
rather than sending it somewhere it did not choose.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from cbcore.config import PluginSpec
from cbcore.log import get_logger
from cbcore.plugins import get_registry
from cbcore.scale.router import EngineLoad, ReplicaView, Router, RouteRequest, RouterError
from cbcore.serve.channel import Submission

log = get_logger(__name__)


class PluginRequestRouter(RequestRouter):
    def initialize_state(self, router: dict[str, Any] | None = None, plugins: tuple[str, ...] = (), **_: Any) -> None:
        spec = PluginSpec.model_validate(router or {"name": "least-loaded"})
        self.router: Router = get_registry(tuple(plugins)).create("router", spec.name, spec.params, "router")
        self.in_flight: Counter[str] = Counter()
        self._placed: dict[str, tuple[str, str]] = {}  # internal request id -> (replica, cbcore request id)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is not None:
            # Without this Ray Serve retries a full or unreachable replica at once, in a busy loop.
            pending_request.routing_context.should_backoff = True
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        now = time.time()
        views = sorted((self._view(r, now) for r in candidate_replicas), key=lambda v: v.replica_id)
        request = route_request(pending_request)
        try:
            order = self.router.rank(request, views)
            ranked = [by_id[i] for i in order if i in by_id]
            if not ranked:
                raise RouterError(f"router {self.router.name!r} ranked no candidate replica: {order}")
        except Exception as exc:
            log.error("router failed", router=self.router.name, request_id=request.request_id, error=str(exc))
            if pending_request is None or pending_request.future.done():
                raise
            pending_request.future.set_exception(exc)
            return [candidate_replicas[:1]]  # lets Ray Serve see the request settled and stop routing it
        return [[r] for r in ranked]

    def _view(self, replica: RunningReplica, now: float) -> ReplicaView:
        uid = replica.replica_id.unique_id
        stats = replica.routing_stats or {}
        load = stats.get("load")
        if load is None:
            return ReplicaView(uid, None, 0.0, self.in_flight[uid])
        return ReplicaView(uid, EngineLoad(**load), max(0.0, now - stats.get("time", now)), self.in_flight[uid])

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        uid = replica_id.unique_id
        request = route_request(pending_request)
        self.in_flight[uid] += 1
        self._placed[pending_request.metadata.internal_request_id] = (uid, request.request_id)
        self.router.on_routed(request, uid)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        placed = self._placed.get(internal_request_id)
        if placed is None or placed[0] != replica_id.unique_id:
            return  # an attempt that was refused, not one that was routed
        del self._placed[internal_request_id]
        uid, request_id = placed
        self.in_flight[uid] = max(0, self.in_flight[uid] - 1)
        self.router.on_done(request_id, uid)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.in_flight.pop(replica_id.unique_id, None)


def route_request(pending: PendingRequest | None) -> RouteRequest:
    """The submission a call carries, as the router sees it."""
    sub = next((a for a in (pending.args if pending is not None else ()) if isinstance(a, Submission)), None)
    if sub is None:
        return RouteRequest(request_id="(no request)")
    f = sub.fields
    return RouteRequest(
        sub.request_id, tuple(sub.prompt_token_ids), f.priority, f.client_id, sub.params.max_new_tokens,
        f.deadline_s, f.attrs,
    )  # fmt: skip
