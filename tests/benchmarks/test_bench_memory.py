"""A long-running engine holds its memory flat: per-step records are bounded.

``pytest tests/benchmarks/test_bench_memory.py --benchmark-enable -s`` runs
20,000 engine steps (a tiny model, four sequences at a time, requests
replaced as they finish) and prints the resident set size along the way;
without ``--benchmark-enable`` the same check runs over 1,500 steps. Either
way the test checks what must not grow: ``Engine.step_stats`` keeps its
fixed number of recent steps, the running totals count every step, and the
resident set grows by less than a few MiB between the first sample and the
last (a per-step leak of even 1 KiB would add 20 MiB over 20,000 steps).
"""

from __future__ import annotations

from cbcore import Engine, SamplingParams
from cbcore.bench.memory import current_rss_bytes
from cbcore.engine_core import STEP_STATS_KEPT
from cbcore.testing import random_prompts, tiny_model

MIB = 2**20


def test_long_run_keeps_records_bounded_and_rss_flat(benchmark, request):
    total = 20_000 if benchmark.enabled else 1_500
    engine = Engine(tiny_model("llama"))
    prompts = random_prompts(64, 4, 24, seed=1)
    params = SamplingParams(max_new_tokens=60, ignore_eos=True)
    listener_steps = 0

    def count(record) -> None:
        nonlocal listener_steps
        listener_steps += 1

    engine.step_listeners.append(count)
    samples: list[tuple[int, int]] = []
    i = 0

    def run() -> None:
        nonlocal i
        while engine.step_totals.steps < total:
            while len(engine.scheduler.running) + len(engine.scheduler.waiting) < 4:
                engine.add_request(prompts[i % len(prompts)], params)
                i += 1
            engine.step()
            steps = engine.step_totals.steps
            if steps % 250 == 0:
                samples.append((steps, current_rss_bytes() or 0))

    if benchmark.enabled:
        benchmark.pedantic(run, rounds=1, iterations=1)
    else:
        run()
    assert engine.step_totals.steps == total == listener_steps
    assert len(engine.step_stats) == STEP_STATS_KEPT
    assert engine.step_stats[-1].step == total
    first, last = samples[1][1], samples[-1][1]  # from step 500: a warm allocator
    if benchmark.enabled:
        shown = samples[3::8]
        print(f"\nRSS over {total} steps: " + ", ".join(f"{s}: {b / MIB:.1f} MiB" for s, b in shown))
    if first:  # /proc is there
        assert last - first < 8 * MIB, f"RSS grew {(last - first) / MIB:.1f} MiB from step 500 to {total}"
