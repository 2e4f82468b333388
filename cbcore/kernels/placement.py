"""One core for each of the serving engine's OpenMP threads, where they are as many as its cores.

A step is a few hundred parallel regions, each as slow as its slowest
thread. Unbound, two threads of a team sometimes share one core while
another process holds the other, and every region then waits for a time
slice: the first request of a guidellm run (whose data worker kept one of
two cores busy) waited 0.75-0.92 s for its first token from `cb serve`,
0.24-0.30 s with each engine thread on a core of its own (vLLM's CPU
server binds its threads likewise; docs/serving.md). Quiet, the placement
changed nothing measurable. Only a team with one thread for each core the
process may use is placed (first CPU of each core), so processes that share
a machine's cores by thread counts (``--threads``, replicas) are never
piled on one. The OpenMP affinity variables, when set, are the user's
choice and win.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

from cbcore.kernels.native import NativeKernel

KERNEL = NativeKernel(
    Path(__file__).with_name("placement.c"), "cb_pin_team", [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
)
AFFINITY_ENV = ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")


def process_cores() -> list[int]:
    """The first CPU of each core this process may run on (hardware threads of one core count once)."""
    cores: dict[tuple[str, str], int] = {}
    for cpu in sorted(os.sched_getaffinity(0)):
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            core = ((topology / "physical_package_id").read_text(), (topology / "core_id").read_text())
        except OSError:
            core = (str(cpu), "")  # no topology: each CPU its own core
        cores.setdefault(core, cpu)
    return list(cores.values())


def pin_openmp_team() -> str | None:
    """Place the calling thread's OpenMP team one thread to a core; None, else why it was left alone."""
    if set_by_user := [name for name in AFFINITY_ENV if os.environ.get(name)]:
        return f"${set_by_user[0]} is set"
    cores, threads = process_cores(), torch.get_num_threads()
    if threads != len(cores):
        return f"{threads} threads for {len(cores)} cores"
    fn, why = KERNEL.load()
    if fn is None:
        return why
    failed = fn((ctypes.c_int * threads)(*cores), threads)
    return {0: None, 1: "the OpenMP team had fewer threads than asked"}.get(failed, "the kernel refused an affinity")
