"""The cost of the guard: policies handed views instead of the engine's objects, per scheduling step.

The step is ``PolicyScheduler.schedule()`` plus the engine's plan check
(``check_plan``), at 256 running and 1,000 waiting sequences, as
tests/benchmarks/test_bench_scheduler.py builds them. ``guarded`` is the
scheduler as the engine runs it; ``bare`` replaces every sequence's view with
the sequence itself and the KV view with the block manager, so the policies
are handed the live objects, as they were before the views. Both cases run
the defaults (fcfs keys stored at arrival, token-budget, chunked-prefill,
recompute) and a queue that is asked ``key()`` for every waiting and
running sequence every step (``priority`` with aging): there every key reads
the view.

``pytest tests/benchmarks/test_bench_guard.py --benchmark-enable -s`` runs
ROUNDS rounds, each timing one step of a fresh scheduler of each kind, the
two alternated (ABAB, the order swapped every round, the garbage collector
off while a step is timed), and prints the medians and their ratio, of the
wall time and of the thread's CPU time. Without
``--benchmark-enable`` (the default addopts) one round runs, as a plain test
that both kinds plan the very same step.
"""

from __future__ import annotations

import gc
import statistics
import time

import pytest
from test_bench_scheduler import NUM_RUNNING, make_scheduler

from cbcore.scheduling.policy_scheduler import PolicyScheduler
from cbcore.scheduling.step import check_plan

ROUNDS = 61
CASES = {"defaults": ("queue", "fcfs", None), "priority-aging": ("queue", "priority", {"aging_s": 5.0})}


def build(case: str, guarded: bool) -> PolicyScheduler:
    sched = make_scheduler(*CASES[case][:2], "roomy", CASES[case][2])
    if not guarded:  # what policies were handed before the views: the engine's own objects
        for seq in [*sched.waiting, *sched.running]:
            seq.view = seq
        sched.blocks.view = sched.blocks
    return sched


def timed_step(sched: PolicyScheduler) -> tuple[tuple[float, float], list[tuple[str, int]]]:
    """(wall, CPU) seconds of one schedule() and its plan check; what it planned (request id, tokens).

    The CPU time of this thread leaves out the time the thread waited for a core, which on a busy
    machine is most of the noise in the wall time.
    """
    gc.collect()
    gc.disable()
    try:
        t0, c0 = time.perf_counter(), time.thread_time()
        out = sched.schedule()
        check_plan(out, sched.blocks, "bench")
        elapsed = time.perf_counter() - t0, time.thread_time() - c0
    finally:
        gc.enable()
    return elapsed, [(s.seq.request_id, s.num_tokens) for s in out.scheduled]


@pytest.mark.parametrize("case", list(CASES))
def test_guard_cost(request, case: str) -> None:
    rounds = ROUNDS if request.config.getoption("benchmark_enable", False) else 1
    times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for i in range(rounds):
        for guarded in (True, False) if i % 2 == 0 else (False, True):
            elapsed, planned = timed_step(build(case, guarded))
            times[guarded].append(elapsed)
            if guarded:
                assert len(planned) > NUM_RUNNING  # the decodes and admissions
                guarded_plan = planned
            else:
                bare_plan = planned
        assert guarded_plan == bare_plan  # the same step, only what the policies are handed differs
    for clock, which in (("wall", 0), ("cpu", 1)):
        guarded_ms, bare_ms = (statistics.median(t[which] for t in times[g]) * 1e3 for g in (True, False))
        print(f"\n{case} ({clock}): guarded {guarded_ms:.3f} ms, bare {bare_ms:.3f} ms, "
              f"ratio {guarded_ms / bare_ms:.3f} (medians of {rounds} alternated rounds)")  # fmt: skip
