"""A policy study that only simulation can run: many policies, thousands of requests, GPU scale.

Runs each policy mix on one workload with one profile and prints a Markdown
table: throughput, TTFT p50/p99 overall and per class (priority value and
client), and the fairness spread across clients::

    .venv/bin/python scripts/sim_study.py --profile h200-llama-3-8b \\
        --workload "gamma:n=10000,rate=45,burstiness=0.2,clients=a:6/b:3/c:1,priorities=0:1/1:4,seed=0" \\
        --set scheduler.budget.max_num_seqs=256 --set scheduler.budget.max_num_batched_tokens=8192 \\
        --policy fcfs --policy priority --policy vtc --policy sjf

The rows are the benchmark's own metrics of runs through its driver
(:func:`cbcore.bench.driver.drive` on simulated engines); the per-class
columns split the same requests by their ``priority`` and ``client_id``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence as Seq

from cbcore.bench.driver import VirtualClock, drive
from cbcore.bench.metrics import completed, percentile, summarize
from cbcore.bench.sources import load_workload
from cbcore.bench.suite import prompt_token_ids
from cbcore.bench.workload import BenchRequest
from cbcore.cli.common import scheduler_from_mix
from cbcore.config import EngineConfig
from cbcore.outputs import RequestOutput
from cbcore.sim.executor import sim_engine
from cbcore.sim.profile import load_profile


def class_ttft(
    requests: Seq[BenchRequest], outputs: Seq[RequestOutput], key: str, q: float
) -> dict[str, float]:
    """TTFT percentile ``q`` (seconds) of the completed requests, per value of ``key``."""
    groups: dict[str, list[float]] = {}
    for req, out in zip(requests, outputs, strict=True):
        if completed(out) and out.metrics.ttft is not None:
            groups.setdefault(f"{key}={getattr(req, key)}", []).append(out.metrics.ttft)
    return {name: percentile(values, q) for name, values in sorted(groups.items())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/sim_study.py", description=__doc__.splitlines()[0])
    parser.add_argument("--profile", required=True)
    parser.add_argument("--workload", required=True)
    parser.add_argument("--policy", action="append", required=True, dest="policies")
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    args = parser.parse_args(argv)
    profile = load_profile(args.profile)
    workload = load_workload(args.workload, profile.model.vocab_size)
    ids = prompt_token_ids(workload, None)
    header = None
    for mix in args.policies:
        config = EngineConfig.from_dict({"scheduler": scheduler_from_mix(mix)}, args.overrides)
        started = time.perf_counter()
        run = drive([sim_engine(config, profile, VirtualClock())], mix, workload, ids)
        took = time.perf_counter() - started
        row = summarize(mix, workload.requests, run.outputs, run.duration_s, steps=run.steps)
        p99 = {
            **class_ttft(workload.requests, run.outputs, "priority", 99),
            **class_ttft(workload.requests, run.outputs, "client_id", 99),
        }
        if header is None:
            header = ["policy", "out tok/s", "TTFT p50 s", "TTFT p99 s", *(f"TTFT p99 {k} s" for k in p99)]
            header += ["fairness spread", "preemptions", "simulated in s"]
            print("| " + " | ".join(header) + " |")
            print("|" + "---|" * len(header))
        cells = [
            f"`{mix}`",
            f"{row['output_tokens_per_s']:.0f}",
            f"{row['ttft_p50_s']:.2f}",
            f"{row['ttft_p99_s']:.2f}",
            *(f"{v:.2f}" for v in p99.values()),
            f"{row['fairness_spread']:.2f}" if row["fairness_spread"] is not None else "-",
            str(row["preemptions"]),
            f"{took:.0f}",
        ]
        print("| " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
