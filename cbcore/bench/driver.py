"""Running one workload through one engine, with arrivals honoured in wall time.

A request is handed to the engine only once its arrival offset has passed on
the wall clock, and its arrival time is the scheduled one, not the moment the
loop got round to it: if a step is in progress when a request arrives, the
wait counts against the request (queue time and TTFT), as it would for a
client of a real server.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any, Protocol

from cbcore.bench.arrivals import Arrivals
from cbcore.bench.workload import BenchRequest, Workload
from cbcore.engine import Engine
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
    kind: str  # "cbcore" or "baseline"
    outputs: list[RequestOutput]
    duration_s: float
    busy_s: float | None = None  # duration minus the time spent waiting for arrivals
    steps: list[StepStats] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)


def sampling_params(req: BenchRequest) -> SamplingParams:
    return SamplingParams(max_new_tokens=req.max_new_tokens, ignore_eos=req.ignore_eos)


def submit(
    engine: EngineCore, req: BenchRequest, token_ids: Seq[int], arrival_time: float
) -> RequestOutput | None:
    """Hand one workload request to ``engine``; a refused request comes back as its final output."""
    try:
        engine.add_request(
            list(token_ids),
            sampling_params(req),
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


def warm_up(engine: Engine, token_ids: Seq[Seq[int]]) -> None:
    """A short prefill + decode through this engine, so first-call costs are not timed.

    The prefix cache is emptied afterwards: the warm-up's prompts are the
    workload's first tokens, and a run must not find them already cached.
    """
    prompts = [list(ids[:8]) for ids in token_ids[:2]]
    engine.generate(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True))
    engine.reset_prefix_cache()


def run_engine(
    engine: Engine,
    name: str,
    workload: Workload,
    token_ids: Seq[Seq[int]],
    *,
    progress: ProgressFactory = no_progress,
    sleep: Callable[[float], None] = time.sleep,
) -> RunResult:
    """Drive ``engine`` step by step, adding each request when it arrives."""
    if engine.has_unfinished():
        raise RuntimeError("run_engine needs an idle engine")
    requests = workload.requests
    clock = engine.clock
    index = {r.request_id: i for i, r in enumerate(requests)}
    done: dict[int, RequestOutput] = {}
    bar = progress(len(requests), name)
    idle = 0.0
    start = clock()
    arrivals = Arrivals(requests, start, token_ids)

    def finish(i: int, out: RequestOutput) -> None:
        done[i] = out
        arrivals.finished(i, out, clock())
        bar.update(1)

    with recorded_steps(engine) as steps:
        while len(done) < len(requests):
            for i in arrivals.due(clock()):
                refused = submit(engine, requests[i], arrivals.prompt(i), arrivals.arrival_time(i))
                if refused is not None:
                    finish(i, refused)
            if engine.has_unfinished():
                for out in engine.step():
                    if out.finished:
                        finish(index[out.request_id], out)
            elif not arrivals.exhausted:
                idle += arrivals.wait(clock, sleep)
    duration = clock() - start
    bar.close()
    return RunResult(
        name=name,
        kind="cbcore",
        outputs=[done[i] for i in range(len(requests))],
        duration_s=duration,
        busy_s=duration - idle,
        steps=steps,
    )


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
