"""The simulation's event loop: arrivals and steps of one or more engines on virtual time.

Each :class:`Replica` is an engine with its own clock, which only its steps
advance; the loop always acts at the earliest moment anything can happen:
the next arrival (handed to the replica a router picks) or the next step of a
busy replica. With one replica this is exactly what the benchmark driver does
in wall time: requests that arrived by the start of a step join before it,
and an idle engine waits for the next arrival. With several, it is N engines
serving one stream of requests side by side.
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Protocol

from cbcore.bench.driver import ProgressFactory, RunResult, no_progress, recorded_steps, submit
from cbcore.bench.workload import BenchRequest, Workload, WorkloadError
from cbcore.engine_core import EngineCore
from cbcore.outputs import RequestOutput
from cbcore.sim.executor import VirtualClock


@dataclass
class Replica:
    """One simulated engine and the clock its steps advance."""

    engine: EngineCore
    clock: VirtualClock

    @property
    def busy(self) -> bool:
        return self.engine.has_unfinished()


class Placement(Protocol):
    """Where each request goes (a router plugin behind an adapter, for N replicas)."""

    def place(self, request: BenchRequest, replicas: Seq[Replica]) -> int: ...
    def done(self, request_id: str, replica: int) -> None: ...


class OneReplica:
    def place(self, request: BenchRequest, replicas: Seq[Replica]) -> int:
        return 0

    def done(self, request_id: str, replica: int) -> None: ...


def simulate_run(
    replicas: Seq[Replica],
    name: str,
    workload: Workload,
    token_ids: Seq[Seq[int]],
    *,
    placement: Placement | None = None,
    progress: ProgressFactory = no_progress,
) -> RunResult:
    """Serve ``workload`` from t=0 of virtual time; outputs in workload order, as ``run_engine`` gives."""
    if not replicas:
        raise ValueError("simulate_run needs at least one replica")
    if any(r.busy for r in replicas):
        raise RuntimeError("simulate_run needs idle replicas")
    if workload.is_closed_loop:
        raise WorkloadError(
            f"workload {workload.name!r} is closed-loop (requests follow others' answers); "
            "the simulator replays open-loop workloads only"
        )
    placement = placement if placement is not None else OneReplica()
    requests = workload.requests
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
    index = {r.request_id: i for i, r in enumerate(requests)}
    start = max(r.clock() for r in replicas)
    for r in replicas:
        r.clock.advance_to(start)
    done: dict[int, RequestOutput] = {}
    bar = progress(len(requests), name)
    idle = 0.0
    end = start
    nxt = 0
    with recorded_steps(*(r.engine for r in replicas)) as steps:
        while len(done) < len(requests):
            t_arrival = start + requests[order[nxt]].arrival_s if nxt < len(order) else math.inf
            busy = [r for r in replicas if r.busy]
            stepper = min(busy, key=lambda r: r.clock()) if busy else None
            t_step = stepper.clock() if stepper is not None else math.inf
            if t_arrival <= t_step:
                i = order[nxt]
                nxt += 1
                req = requests[i]
                where = _place(placement, req, replicas)
                target = replicas[where]
                if not target.busy:
                    if len(replicas) == 1:
                        idle += max(0.0, t_arrival - target.clock())
                    target.clock.advance_to(t_arrival)
                refused = submit(target.engine, req, token_ids[i], t_arrival)
                if refused is not None:
                    done[i] = refused
                    placement.done(req.request_id, where)
                    bar.update(1)
                continue
            if stepper is None:  # nothing runs and nothing arrives, yet requests are missing
                raise RuntimeError(f"simulation ended with {len(requests) - len(done)} requests unaccounted for")
            for out in stepper.engine.step():
                if out.finished:
                    done[index[out.request_id]] = out
                    placement.done(out.request_id, replicas.index(stepper))
                    bar.update(1)
            end = max(end, stepper.clock())
    bar.close()
    duration = end - start
    return RunResult(
        name=name,
        kind="simulated",
        outputs=[done[i] for i in range(len(requests))],
        duration_s=duration,
        busy_s=duration - idle if len(replicas) == 1 else None,
        steps=steps,
    )


def _place(placement: Placement, request: BenchRequest, replicas: Seq[Replica]) -> int:
    choice = placement.place(request, replicas)
    if isinstance(choice, bool) or not isinstance(choice, int) or not 0 <= choice < len(replicas):
        raise ValueError(
            f"placement returned {choice!r} for {request.request_id}; expected 0..{len(replicas) - 1}"
        )
    return choice
