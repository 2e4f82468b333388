"""Driving a workload through engines: one loop, on wall time or on virtual time.

The loop always acts at the earliest moment anything can happen: the next
arrival (handed to the engine a placement picks) or the next step of a busy
engine. What time is, is each engine's own clock: the real engine's reads the
wall clock, and waiting for an arrival sleeps until it; the simulator's is a
:class:`VirtualClock` that only its steps advance (by what each costs), and
waiting jumps to the arrival. So one loop serves ``cb bench`` and
``cb simulate``, and a policy sees the same sequence of events in both.

A request's arrival time is the scheduled one, not the moment the loop got
round to it: if a step is in progress when a request arrives, the wait counts
against the request (queue time and TTFT), as it would for a client of a real
server. Requests that arrived by the start of a step join before it.

With several engines (simulated replicas, each on its own virtual clock) the
loop steps whichever busy engine's clock is earliest, so N engines serve one
stream of requests side by side on one timeline.
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
from array import array
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from cbcore.bench.arrivals import Arrivals
from cbcore.bench.synthetic import PromptIds
from cbcore.bench.workload import BenchRequest, Workload
from cbcore.engine_core import EngineCore, RequestError, StepRecord
from cbcore.outputs import RequestOutput, StepStats
from cbcore.scheduling.sampling_params import SamplingParams


class Progress(Protocol):
    def update(self, n: int) -> Any: ...
    def close(self) -> Any: ...


ProgressFactory = Callable[[int, str], Progress]


class _NoProgress:
    def update(self, n: int) -> None: ...
    def close(self) -> None: ...


def no_progress(total: int, desc: str) -> Progress:
    return _NoProgress()


@dataclass
class RunResult:
    """What one configuration (or baseline) did with the workload; outputs in workload order."""

    name: str
    kind: str  # "cbcore", "simulated" or "baseline"
    outputs: list[RequestOutput]
    duration_s: float
    busy_s: float | None = None  # duration minus the time spent waiting for arrivals
    steps: list[StepStats] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)


class VirtualClock:
    """Simulated seconds; only an executor (a step's cost) and waiting for an arrival move it."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if not seconds >= 0:
            raise ValueError(f"the clock cannot go back or stall on a non-number: {seconds}")
        self.now += seconds

    def wait_until(self, when: float) -> None:
        self.now = max(self.now, when)


class WallClock:
    """An engine's own clock (wall time), where waiting is sleeping."""

    def __init__(self, now: Callable[[], float], sleep: Callable[[float], None] = time.sleep) -> None:
        self.now, self.sleep = now, sleep

    def __call__(self) -> float:
        return self.now()

    def wait_until(self, when: float) -> None:
        if (delay := when - self.now()) > 0:
            self.sleep(delay)


class Placement(Protocol):
    """Which engine serves each request (a router plugin behind an adapter, for N replicas)."""

    def place(self, request: BenchRequest, prompt: Seq[int], engines: Seq[EngineCore]) -> int: ...
    def done(self, request_id: str, engine: int) -> None: ...


class OneEngine:
    def place(self, request: BenchRequest, prompt: Seq[int], engines: Seq[EngineCore]) -> int:
        return 0

    def done(self, request_id: str, engine: int) -> None: ...


def submit(
    engine: EngineCore, req: BenchRequest, token_ids: Seq[int], arrival_time: float, compact: bool = False
) -> RequestOutput | None:
    """Hand one workload request to ``engine``; a refused request comes back as its final output.

    ``compact`` (a simulated engine): the ids go as an ``array('i')``, which the
    engine keeps as the sequence's token array (4 bytes a token instead of a
    list's pointer and int object), so that thousands of waiting requests with
    long prompts fit in memory; a synthetic prompt is drawn straight into it.
    """
    prompt: Seq[int] = token_ids.array() if compact and isinstance(token_ids, PromptIds) else list(token_ids)
    if compact and isinstance(prompt, list):
        with contextlib.suppress(OverflowError):  # an id past 32 bits stays a list: the engine refuses it by name
            prompt = array("i", prompt)
    try:
        engine.add_request(
            prompt,
            req.sampling_params(),
            request_id=req.request_id,
            priority=req.priority,
            client_id=req.client_id,
            deadline_s=req.deadline_s,
            attrs=req.attrs,
            arrival_time=arrival_time,
        )
    except RequestError as exc:
        return RequestOutput.rejected(req.request_id, list(token_ids), str(exc))
    return None


def warm_up(engine: EngineCore, token_ids: Seq[Seq[int]]) -> None:
    """A short prefill + decode through this engine, so first-call costs are not timed.

    The prefix cache is emptied afterwards: the warm-up's prompts are the
    workload's first tokens, and a run must not find them already cached.
    """
    prompts = [list(ids[:8]) for ids in token_ids[:2]]
    engine.generate(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True))
    engine.reset_prefix_cache()


def drive(
    engines: Seq[EngineCore],
    name: str,
    workload: Workload,
    token_ids: Seq[Seq[int]],
    *,
    placement: Placement | None = None,
    progress: ProgressFactory = no_progress,
    sleep: Callable[[float], None] = time.sleep,
) -> RunResult:
    """Serve ``workload`` with ``engines`` from now on their clocks; outputs in workload order.

    An engine whose clock can wait by itself (a :class:`VirtualClock`) jumps
    to each arrival; any other clock is wall time, and waiting calls ``sleep``.
    """
    if not engines:
        raise ValueError("drive needs at least one engine")
    if any(e.has_unfinished() for e in engines):
        raise RuntimeError("drive needs idle engines")
    simulated = all(isinstance(e.clock, VirtualClock) for e in engines)
    if len(engines) > 1 and not simulated:
        raise ValueError("several engines share one timeline only on virtual clocks (simulated replicas)")
    clocks = [e.clock if isinstance(e.clock, VirtualClock) else WallClock(e.clock, sleep) for e in engines]
    placement = placement if placement is not None else OneEngine()
    requests = workload.requests
    index = {r.request_id: i for i, r in enumerate(requests)}
    start = max(clock() for clock in clocks)
    for clock in clocks:
        clock.wait_until(start)
    arrivals = Arrivals(requests, start, token_ids)
    done: dict[int, RequestOutput] = {}
    bar = progress(len(requests), name)
    idle = 0.0

    def finish(i: int, out: RequestOutput, where: int) -> None:
        if isinstance(prompt := arrivals.prompt(i), PromptIds):
            out = replace(out, prompt_token_ids=prompt)  # the recipe, not a copy of its ids
        elif not isinstance(out.prompt_token_ids, list):  # a simulated engine's token array (a view of it)
            out = replace(out, prompt_token_ids=list(out.prompt_token_ids))
        if not isinstance(out.output_token_ids, list):
            out = replace(out, output_token_ids=list(out.output_token_ids))
        done[i] = out
        arrivals.finished(i, out, clocks[where]())
        placement.done(out.request_id, where)
        bar.update(1)

    with recorded_steps(*engines) as steps, contextlib.ExitStack() as after:
        if simulated:  # what exists now (modules, the workload) lives on: the collector need not walk it again
            gc.freeze()
            after.callback(gc.unfreeze)
        while len(done) < len(requests):
            due = arrivals.next_time()  # None: the next requests wait on answers still running
            busy = [j for j, e in enumerate(engines) if e.has_unfinished()]
            stepper = min(busy, key=lambda j: clocks[j]()) if busy else None
            if due is not None and due <= (clocks[stepper]() if stepper is not None else math.inf):
                i = arrivals.pop()
                where = _place(placement, requests[i], arrivals.prompt(i), engines)
                if not engines[where].has_unfinished():
                    if len(engines) == 1:
                        idle += max(0.0, due - clocks[where]())
                    clocks[where].wait_until(due)
                refused = submit(engines[where], requests[i], arrivals.prompt(i), due, simulated)
                if refused is not None:
                    finish(i, refused, where)
            elif stepper is not None:
                for out in engines[stepper].step():
                    if out.finished:
                        finish(index[out.request_id], out, stepper)
            else:
                raise RuntimeError(
                    f"{len(requests) - len(done)} requests wait on one that never finished, and nothing runs"
                )
    bar.close()
    duration = max(clock() for clock in clocks) - start
    return RunResult(
        name=name,
        kind="simulated" if simulated else "cbcore",
        outputs=[done[i] for i in range(len(requests))],
        duration_s=duration,
        busy_s=duration - idle if len(engines) == 1 else None,
        steps=steps,
    )


def _place(placement: Placement, request: BenchRequest, prompt: Seq[int], engines: Seq[EngineCore]) -> int:
    choice = placement.place(request, prompt, engines)
    if isinstance(choice, bool) or not isinstance(choice, int) or not 0 <= choice < len(engines):
        raise ValueError(f"placement returned {choice!r} for {request.request_id}; expected 0..{len(engines) - 1}")
    return choice


@contextlib.contextmanager
def recorded_steps(*engines: EngineCore) -> Iterator[list[StepStats]]:
    """Every step the engines run inside the block, in order (engines keep only recent ones)."""
    steps: list[StepStats] = []

    def listener(record: StepRecord) -> None:
        steps.append(record.stats)

    for engine in engines:
        engine.step_listeners.append(listener)
    try:
        yield steps
    finally:
        for engine in engines:
            engine.step_listeners.remove(listener)
