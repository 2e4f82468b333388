"""Speed of the simulator: 10,000 requests, up to 256 running, on the H200 roofline profile.

``pytest tests/benchmarks/test_bench_simulate.py --benchmark-enable -s`` times
one simulation of the full trace and prints its wall and CPU seconds, steps
and requests per second; without ``--benchmark-enable`` (the default addopts)
it runs a 300-request version once, as a plain test of the setup. Every step
runs the real composed scheduler and the engine's bookkeeping for up to 256
sequences, so this is also the scheduler's microbenchmark at scale.
"""

from __future__ import annotations

import time

from cbcore.bench.generator import generate
from cbcore.config import EngineConfig
from cbcore.sim.profile import load_profile
from cbcore.sim.suite import simulate_suite

TRACE = "poisson:n={n},rate=60,burstiness=0.5,lengths=sharegpt,clients=a:3/b:1,priorities=0:3/1:1,seed=0"
LIMITS = ["scheduler.budget.max_num_seqs=256", "scheduler.budget.max_num_batched_tokens=8192"]


def test_simulate_10k_requests(benchmark) -> None:
    n = 300 if benchmark.disabled else 10_000
    profile = load_profile("h200-llama-3-8b")
    workload = generate(TRACE.format(n=n), profile.model.vocab_size)
    ids = [list(r.prompt_token_ids) for r in workload.requests]
    config = EngineConfig.from_dict({}, LIMITS)
    clocks: dict[str, float] = {}

    def run():
        wall, cpu = time.perf_counter(), time.process_time()
        result = simulate_suite(profile, workload, ids, [("fcfs", config)])
        clocks.update(wall=time.perf_counter() - wall, cpu=time.process_time() - cpu)
        return result

    result = benchmark.pedantic(run, rounds=1, iterations=1)
    row = result.rows[0]
    assert row["completed"] == n
    assert row["max_seqs_per_step"] == 256 or n < 1000
    print(
        f"\n{n} requests, {row['steps']} steps, max {row['max_seqs_per_step']} running: "
        f"{clocks['wall']:.1f} s wall, {clocks['cpu']:.1f} s CPU, {n / clocks['wall']:.0f} requests/s"
    )
