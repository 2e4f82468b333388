"""Handing the engine to the server's thread lets the builder's OpenMP workers go (``release_openmp_workers``)."""

from __future__ import annotations

import sys

import pytest
from support.script_processes import last_line_of_each

# Counts the process's threads, not seconds. A region of two threads leaves one pooled worker behind
# on the thread that ran it; EngineLoop.start must end it (and adds the engine thread, which has made
# no pool yet: no request was sent).
SCRIPT = """
import asyncio, os, sys, time
import torch
torch.set_num_threads(2)
import cbcore.serve.engine_loop as engine_loop
from cbcore import Engine
from cbcore.testing.tiny_models import tiny_model

def threads():
    return len(os.listdir("/proc/self/task"))

def settle(want):
    for _ in range(200):
        if threads() == want:
            break
        time.sleep(0.01)
    return threads()

if sys.argv[1] == "kept":
    engine_loop.release_openmp_workers = lambda: "off for the control"
engine_loop.pin_openmp_team = lambda: "off: its parallel region would make the engine thread's pool now"
before = threads()
engine = Engine(tiny_model("llama"))
torch.randn(1 << 22).exp_()  # a parallel region on this thread (building has run some): one pooled worker
with_pool = settle(before + 1)
loop = engine_loop.EngineLoop(engine)
loop.start(asyncio.new_event_loop())
print(before, with_pool, settle(with_pool))  # released: the engine thread replaces the worker
loop.stop()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts /proc/self/task; libgomp")
def test_starting_the_engine_thread_ends_the_builders_openmp_workers():
    released, kept = last_line_of_each(SCRIPT, "released", "kept")
    for mode, (before, with_pool, after_start) in (("released", released), ("kept", kept)):
        assert with_pool == before + 1  # the region left a worker (else this test would prove nothing)
        want = with_pool if mode == "released" else with_pool + 1  # + the engine thread, - the worker
        assert after_start == want, (
            f"{before} threads, {with_pool} with the pool, {after_start} after start ({mode})"
        )
