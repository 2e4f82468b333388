"""The serving engine's OpenMP threads run one to a core (``pin_openmp_team``), and only where that is safe.

Checked through the kernel's own record of each thread's CPUs (``/proc/self/task/*/status``), in fresh
processes: placing threads is process state that must not leak into the test runner.
"""

from __future__ import annotations

import sys

import pytest
from support.script_processes import last_line_of_each

# Prints: 1 if the engine thread runs on the first core only, and how many distinct CPUs the threads that
# run on one CPU only are on (the engine thread and its team's workers, once placed).
SCRIPT = """
import asyncio, os, sys, time
import torch
import cbcore.serve.engine_loop as engine_loop
from cbcore.kernels.placement import pin_openmp_team, process_cores

cores = process_cores()
torch.set_num_threads(len(cores) + (1 if sys.argv[1] == "more-threads" else 0))
if sys.argv[1] == "user-affinity":
    os.environ["OMP_PLACES"] = "threads"  # after the runtime read it: only cbcore sees it
from cbcore import Engine
from cbcore.testing.tiny_models import tiny_model

said = []
engine_loop.pin_openmp_team = lambda: said.append(pin_openmp_team()) or said[-1]

def cpus(tid):
    status = open(f"/proc/self/task/{tid}/status").read()
    text = next(line for line in status.splitlines() if line.startswith("Cpus_allowed_list")).split()[1]
    return {int(p) for part in text.split(",") for p in range(int(part.split("-")[0]), int(part.split("-")[-1]) + 1)}

loop = engine_loop.EngineLoop(Engine(tiny_model("llama")))
loop.start(asyncio.new_event_loop())
for _ in range(1000):  # the engine thread places its team as it starts
    if said:
        break
    time.sleep(0.01)
assert said, "the engine thread did not place its team"
single = [cpus(tid) for tid in os.listdir("/proc/self/task") if len(cpus(tid)) == 1]
print(int(cpus(loop._thread.native_id) == {cores[0]}), len(set().union(*single)))
loop.stop()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task; sched_setaffinity")
def test_the_engine_thread_places_its_team_one_thread_to_a_core_only_when_safe():
    from cbcore.kernels.placement import process_cores

    cores = len(process_cores())
    if cores < 2:
        pytest.skip("one core: nothing to place")
    pinned, more_threads, user = last_line_of_each(SCRIPT, "pinned", "more-threads", "user-affinity")
    assert pinned == [1, cores], f"placed: engine thread on the first core {pinned[0]}, threads on one CPU {pinned[1]}"
    assert more_threads == [0, 0]  # a team larger than the cores is left to the system
    assert user == [0, 0]  # the user's OpenMP affinity variables win


def test_why_a_team_is_left_alone(monkeypatch):
    import cbcore.kernels.placement as placement

    monkeypatch.setenv("GOMP_CPU_AFFINITY", "0 1")
    assert placement.pin_openmp_team() == "$GOMP_CPU_AFFINITY is set"
    for name in placement.AFFINITY_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(placement, "process_cores", lambda: list(range(64)))
    assert placement.pin_openmp_team().endswith("threads for 64 cores")
