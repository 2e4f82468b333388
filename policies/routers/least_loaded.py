"""Least loaded: the replica with the smallest load by a chosen measure."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from cbcore.scale.router import ReplicaView, Router, RouteRequest

LoadMeasure = Literal["in-flight", "queue", "kv"]

#: How each measure scores a replica (smaller is less loaded); ties fall to fewer in flight, then id.
MEASURES: dict[str, Callable[[ReplicaView], tuple[float, ...]]] = {
    # The router's own exact count of unfinished requests it sent there.
    "in-flight": lambda r: (r.num_in_flight,),
    # Waiting + running as the replica last reported them (stale by up to the load interval).
    "queue": lambda r: (r.queue_len, r.num_in_flight),
    # KV blocks in use as last reported: long prompts and long outputs weigh more than short ones.
    "kv": lambda r: (r.kv_usage, r.num_in_flight),
}


class LoadParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    by: LoadMeasure = Field(
        "in-flight",
        description="requests this router has in flight there (exact); waiting + running as the "
        "replica last reported; or its reported KV block use",
    )


def load_key(by: str) -> Callable[[ReplicaView], tuple]:
    score = MEASURES[by]
    return lambda r: (*score(r), r.replica_id)


class LeastLoaded(Router):
    """Send each request where the load is smallest.

    ``by: in-flight`` counts what this router itself has outstanding on each
    replica, which is exact at every decision. ``queue`` and ``kv`` read the
    replicas' reports, which see work sent by other routers too but lag by
    up to the report interval: between two reports every request goes to the
    same replica (simulation shows the herd this causes).
    """

    name = "least-loaded"
    Params = LoadParams

    def choose(self, request: RouteRequest, replicas: Seq[ReplicaView]) -> str:
        return min(replicas, key=load_key(self.params.by)).replica_id
