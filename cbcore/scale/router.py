"""The fifth extension point: which replica serves a request.

When several engines (replicas) serve one model, a router picks a replica for
each arriving request. It is a policy like the four per-engine kinds: a class
with a ``name``, ``kind = "router"`` and a pydantic ``Params`` model,
registered through ``cbcore_register_policies`` and named in the config
(``router: {name: least-loaded}``). The same class runs behind the Ray Serve
application (:mod:`cbcore.scale`) and in simulation with N replicas.

A router sees, per replica, a :class:`ReplicaView`: the replica's own load
snapshot (:func:`engine_load`: waiting, running, KV blocks), refreshed every
``load_interval_s`` and therefore possibly stale, and the router's exact
count of requests it has sent there that have not finished; the load holds
waiting and running token counts, KV use and the recent step time. It sees
the request as a :class:`RouteRequest`: prompt token ids (for cache
affinity), its output-length hint (``max_tokens``, and the router's
:meth:`Router.predicted_output_len` hook), priority, client id, deadline and
attrs: what a policy reads about a request, before any replica has it. Whatever a router returns is checked by
:func:`checked_choice`; a wrong answer is a :class:`RouterError` naming the
plugin, never a request sent nowhere.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from pydantic import BaseModel

from cbcore.plugins import NoParams
from cbcore.scheduling.request import EMPTY_ATTRS
from cbcore.scheduling.sequence import SequenceStatus


class LoadView(Protocol):
    """The part of an engine's load snapshot routers read (:class:`EngineLoad` fits it)."""

    num_waiting: int
    num_running: int
    num_waiting_tokens: int  # prompt tokens the waiting requests still have to prefill
    num_running_tokens: int  # tokens the running requests hold or compute
    kv_blocks_used: int
    kv_blocks_total: int
    recent_step_s: float  # mean duration of the replica's last steps


@dataclass(frozen=True)
class EngineLoad:
    """How busy an engine is right now: what routers, ``/metrics`` and benchmarks read.

    A snapshot taken between steps, so it is consistent with itself; counted
    from the engine's own requests, so it holds for any scheduler.
    """

    num_waiting: int
    num_running: int
    num_swapped: int
    kv_blocks_used: int
    kv_blocks_total: int
    num_preemptions_total: int
    prefix_cache_queries_tokens: int = 0
    prefix_cache_hits_tokens: int = 0
    num_waiting_tokens: int = 0  # prompt (and recompute) tokens the waiting requests still have to prefill
    num_running_tokens: int = 0  # tokens the running requests hold in the KV cache or are computing
    recent_step_s: float = 0.0  # mean duration of the last steps (0.0 before the first)

    @property
    def kv_usage(self) -> float:
        """Share of the device KV pool in use (0.0 to 1.0)."""
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


def engine_load(engine: Any) -> EngineLoad:
    """``engine``'s load now (an :class:`~cbcore.engine_core.EngineCore`; read it between steps)."""
    blocks, live = engine.scheduler.blocks, engine.requests
    # The server reads this after every step: one plain pass, no properties, per request.
    waiting, running = SequenceStatus.WAITING, SequenceStatus.RUNNING
    num_waiting = num_running = waiting_tokens = running_tokens = 0
    for seq in live.values():
        status = seq.status
        if status is waiting:
            num_waiting += 1
            waiting_tokens += len(seq.token_ids) - seq.num_computed_tokens
        elif status is running:
            num_running += 1
            running_tokens += len(seq.token_ids)
    recent = list(itertools.islice(reversed(engine.step_stats), 16))
    return EngineLoad(
        num_waiting=num_waiting,
        num_running=num_running,
        num_swapped=len(live) - num_waiting - num_running,
        kv_blocks_used=blocks.num_used_blocks,
        kv_blocks_total=blocks.num_blocks,
        num_preemptions_total=engine.step_totals.preemptions,  # counted by the engine: holds for any Scheduler
        prefix_cache_queries_tokens=blocks.prefix_cache_queries_tokens,
        prefix_cache_hits_tokens=blocks.prefix_cache_hits_tokens,
        num_waiting_tokens=waiting_tokens,
        num_running_tokens=running_tokens,
        recent_step_s=sum(s.total_s for s in recent) / len(recent) if recent else 0.0,
    )


@dataclass(frozen=True)
class ReplicaView:
    """What a router may read about one replica."""

    replica_id: str
    #: The replica's last reported load, or None before its first report.
    load: LoadView | None = None
    #: Seconds since ``load`` was taken (by the router's clock).
    load_age_s: float = 0.0
    #: Requests this router sent to the replica that have not finished yet.
    num_in_flight: int = 0

    @property
    def queue_len(self) -> int:
        """Waiting + running requests the replica last reported (0 before a report)."""
        return 0 if self.load is None else self.load.num_waiting + self.load.num_running

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use at the last report (0.0 before a report)."""
        if self.load is None or self.load.kv_blocks_total <= 0:
            return 0.0
        return self.load.kv_blocks_used / self.load.kv_blocks_total


@dataclass(frozen=True)
class RouteRequest:
    """What a router may read about the request being placed: what a policy reads, before it runs."""

    request_id: str
    prompt_token_ids: tuple[int, ...] = field(default=(), repr=False)
    priority: int = 0
    client_id: str = "default"
    #: The output-length hint: the most tokens the request may generate (its ``max_tokens``).
    max_tokens: int | None = None
    deadline_s: float | None = None  # seconds after arrival by which it should be done
    attrs: Mapping[str, Any] = field(default_factory=lambda: EMPTY_ATTRS, repr=False)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class RouterError(RuntimeError):
    """A router answered something that names no candidate replica."""


class Router:
    """Base of every router. Override :meth:`choose`; the events are optional."""

    name: ClassVar[str]
    kind: ClassVar[str] = "router"
    Params: ClassVar[type[BaseModel]] = NoParams

    def __init__(self, params: BaseModel | None = None) -> None:
        self.params = params if params is not None else self.Params()

    def predicted_output_len(self, request: RouteRequest) -> float:
        """The output-length hook: tokens ``request`` is expected to generate (default: its ``max_tokens``).

        Override it (or plug a predictor in through ``Params``, as contrib ``sjf`` does for queues) for a
        router that balances expected work rather than request counts.
        """
        return float(request.max_tokens or 0)

    def choose(self, request: RouteRequest, replicas: Seq[ReplicaView]) -> str:
        """Return the ``replica_id`` of one of ``replicas`` (never empty, sorted by id)."""
        raise NotImplementedError

    def rank(self, request: RouteRequest, replicas: Seq[ReplicaView]) -> list[str]:
        """Replica ids, most preferred first: where to go when the first choice cannot take it.

        The default puts :meth:`choose`'s answer first and the others by
        fewest requests in flight.
        """
        first = checked_choice(self, request, replicas)
        rest = sorted((r for r in replicas if r.replica_id != first), key=lambda r: (r.num_in_flight, r.replica_id))
        return [first, *(r.replica_id for r in rest)]

    # Events: a request placed on a replica, and a request that left it (finished, failed or aborted).
    def on_routed(self, request: RouteRequest, replica_id: str) -> None: ...
    def on_done(self, request_id: str, replica_id: str) -> None: ...


def checked_choice(router: Router, request: RouteRequest, replicas: Seq[ReplicaView]) -> str:
    """Ask ``router`` for a replica and verify the answer names one of ``replicas``."""
    if not replicas:
        raise RouterError(f"no replica is available to serve request {request.request_id!r}")
    answer = router.choose(request, replicas)
    if not any(r.replica_id == answer for r in replicas):
        raise RouterError(
            f"router {type(router).__module__}.{type(router).__qualname__} ({router.name!r}) chose "
            f"{answer!r} for request {request.request_id!r}, which is not one of the candidate "
            f"replicas {[r.replica_id for r in replicas]}"
        )
    return answer


def least_in_flight(replicas: Seq[ReplicaView]) -> ReplicaView:
    """The replica with the fewest requests in flight (ties: smallest id)."""
    return min(replicas, key=lambda r: (r.num_in_flight, r.replica_id))
