"""Cost of a measured GPU profile: building it, and pricing one step.

``pytest tests/benchmarks/test_bench_gpu_profile.py --benchmark-enable -s`` records the step shapes
of a simulated run (A100, Llama-2-7B, TP 1; 128 sequences and 4,096 tokens a step) and prices them
again and again, alternating the measured profile's pricer and the H200 roofline's, five rounds;
it prints each round's microseconds per step and the medians. Without ``--benchmark-enable`` it
runs a small version once, as a plain test.
"""

from __future__ import annotations

import statistics
import time

from cbcore.bench.generator import generate
from cbcore.config import EngineConfig
from cbcore.sim import executor
from cbcore.sim.gpu import cost
from cbcore.sim.profile import load_profile
from cbcore.sim.shape import StepShape
from cbcore.sim.suite import simulate_suite

TRACE = "poisson:n={n},rate=6,lengths=uniform,input_len=1155,output_len=211,max_input=3800,seed=0"
LIMITS = ["scheduler.budget.max_num_seqs=128", "scheduler.budget.max_num_batched_tokens=4096"]


def _recorded_shapes(n: int) -> list[StepShape]:
    profile = load_profile("a100-llama-2-7b-tp1")
    workload = generate(TRACE.format(n=n), profile.model.vocab_size)
    shapes: list[StepShape] = []
    prepare = executor.SimExecutor.prepare

    def record(self, plan):  # type: ignore[no-untyped-def]
        shape = prepare(self, plan)
        shapes.append(shape)
        return shape

    executor.SimExecutor.prepare = record  # type: ignore[method-assign]
    try:
        ids = [list(r.prompt_token_ids) for r in workload.requests]
        simulate_suite(profile, workload, ids, [("fcfs", EngineConfig.from_dict({}, LIMITS))])
    finally:
        executor.SimExecutor.prepare = prepare  # type: ignore[method-assign]
    return shapes


def test_pricing_a_step(benchmark) -> None:
    small = benchmark.disabled
    cost._arrays.cache_clear()
    started = time.perf_counter()
    measured = load_profile("a100-llama-3-8b-tp1").cost.pricer(16)  # type: ignore[union-attr]
    built_ms = 1e3 * (time.perf_counter() - started)
    shapes = _recorded_shapes(200 if small else 2000)
    pricers = {"measured a100-llama-2-7b-tp1": load_profile("a100-llama-2-7b-tp1").pricer(16),
               "roofline h200-llama-3-8b": load_profile("h200-llama-3-8b").pricer(16)}  # fmt: skip
    rounds: dict[str, list[float]] = {name: [] for name in pricers}

    def run() -> None:
        for _ in range(1 if small else 5):
            for name, price in pricers.items():
                t = time.perf_counter()
                for shape in shapes:
                    price(shape)
                rounds[name].append(1e6 * (time.perf_counter() - t) / len(shapes))

    benchmark.pedantic(run, rounds=1, iterations=1)
    assert measured(shapes[0]) > 0 and len(shapes) > 100
    print(f"\nbuilding a100-llama-3-8b-tp1 (32,768 token counts): {built_ms:.1f} ms; {len(shapes)} recorded steps")
    for name, times in rounds.items():
        print(f"{name}: median {statistics.median(times):.2f} us/step ({', '.join(f'{t:.2f}' for t in times)})")
