"""The adapter's Python cost per step: vLLM's schedulers alone against cbcore_vllm.Scheduler.

    .venv-vllm/bin/python contrib/vllm/bench_schedule.py --running 16 64 256 --rounds 5

At the scheduler level (``cbcore_vllm.harness``: no model runs), N requests
decode steadily; each round times a block of steps of each scheduler in
turn (the order reversed every other round: ABC CBA ...), so that a shared
machine's drift falls on all alike. A step is
``schedule()`` plus ``update_from_output()`` (the adapter works in both);
the fake model output is built outside the timed span. Prints the median
per-step time of each and the adapter's extra, per N and policy. With
``--profile N`` it prints cProfile's top functions of the adapter's steps at
N running requests instead.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import cbcore_vllm.harness as harness
import vllm
from cbcore_vllm.shim import for_version

PROMPT = 32
# What runs: vLLM's own schedulers (Scheduler: what --no-async-scheduling uses; AsyncScheduler: the
# adapter's base class, what vLLM uses by default) and the adapter.
CLASSES = {
    "vLLM Scheduler": None,
    "vLLM AsyncScheduler": "vllm.v1.core.sched.async_scheduler.AsyncScheduler",
    "with the adapter": "cbcore_vllm.Scheduler",
}
POLICIES = {
    "fcfs": {"queue": {"name": "fcfs"}},
    "vtc": {"queue": {"name": "vtc"}},  # key(seq, now) re-evaluated every step: order() each step
}


def build(kind: str, running: int, policy: str) -> Any:
    cbcore = {"scheduler": {**POLICIES[policy], "budget": {"name": "token-budget", "max_num_seqs": running,
                                                          "max_num_batched_tokens": 8192}}}  # fmt: skip
    scheduler = harness.build_scheduler(
        cbcore,
        max_num_seqs=running,
        max_num_batched_tokens=8192,
        num_blocks=running * 40,
        max_model_len=1024,
        scheduler_cls=CLASSES[kind],
    )
    for i in range(running):
        scheduler.add_request(harness.make_request(
            {"id": f"r{i}", "prompt": [1, 10 + i % 400, *range(3, PROMPT + 1)], "max_tokens": 1024 - PROMPT - 8,
             "xargs": {"client_id": f"c{i % 4}"}}))  # fmt: skip
    return scheduler


class Stepper:
    """Steps one scheduler synchronously; times schedule() + update_from_output()."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.internals = for_version(vllm.__version__, allow_untested=True)
        self.n = 0

    def step(self) -> float:
        s = self.scheduler
        t0 = time.perf_counter()
        out = s.schedule()
        t1 = time.perf_counter()
        self.n += 1
        sampled = {rid: ([] if s.requests[rid].is_prefill_chunk else [3 + self.n % 400]) for rid in out.num_scheduled_tokens}
        runner_output = self.internals.runner_output(sampled)
        t2 = time.perf_counter()
        s.update_from_output(out, runner_output)
        return (t1 - t0) + (time.perf_counter() - t2)


def measure(running: int, policy: str, rounds: int, steps: int) -> dict[str, float]:
    kinds = tuple(CLASSES)
    steppers = {k: Stepper(build(k, running, policy)) for k in kinds}
    for stepper in steppers.values():  # past the prefills: everyone decoding
        for _ in range(4 + running * PROMPT // 8192):
            stepper.step()
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(rounds):
        for k in kinds if r % 2 == 0 else reversed(kinds):
            times[k].extend(steppers[k].step() for _ in range(steps))
    return {k: statistics.median(v) for k, v in times.items()}


def profile(running: int, policy: str, steps: int) -> None:
    import cProfile
    import pstats

    stepper = Stepper(build("with the adapter", running, policy))
    for _ in range(8):
        stepper.step()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        stepper.step()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--running", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--policy", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    parser.add_argument("--rounds", type=int, default=6, help="blocks per scheduler, alternated (ABBA...)")
    parser.add_argument("--steps", type=int, default=40, help="steps per block")
    parser.add_argument("--profile", type=int, metavar="N", help="profile the adapter at N running requests")
    args = parser.parse_args()
    if args.profile:
        profile(args.profile, args.policy[0], args.steps * 4)
        return 0
    print(f"vLLM {vllm.__version__}, scheduler level, synchronous; median us per step "
          f"(schedule + update_from_output), {args.rounds} alternated blocks of {args.steps} steps")  # fmt: skip
    print("| running | policy | vLLM Scheduler | vLLM AsyncScheduler | with the adapter | adapter's extra over AsyncScheduler |")
    print("|---:|---|---:|---:|---:|---:|")
    for running in args.running:
        for policy in args.policy:
            m = {k: v * 1e6 for k, v in measure(running, policy, args.rounds, args.steps).items()}
            base, adapter = m["vLLM AsyncScheduler"], m["with the adapter"]
            print(f"| {running} | {policy} | {m['vLLM Scheduler']:.0f} | {base:.0f} | {adapter:.0f} | "
                  f"{adapter - base:.0f} ({adapter / base:.2f}x) |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
