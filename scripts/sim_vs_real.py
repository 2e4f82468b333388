"""How close `cb simulate` comes to real runs, and where the difference comes from.

``run`` drives the real engine through a workload for each policy mix,
``--repeat`` times with the mixes interleaved (the machine drifts), and keeps
each run's metrics and every step's shape and measured time. ``compare``
simulates the same workload and configurations with one or more profiles and
prints, per mix, the real figure (median over the repeats) beside the
simulated one, then splits the error in two:

- *schedule*: the simulated run's steps and preemptions against the real ones
  (the simulator runs the engine's own scheduler, so these should agree);
- *price*: the real run's own steps priced by the profile, against their
  measured time. With the schedule reproduced, this is the whole error: it
  is the step-time model's error plus the machine running faster or slower
  than when it was profiled.

Each figure also shows the real runs' own spread (the largest distance of a
repeat from their median): past capacity, a step that ends a little later
moves an arrival into another step, the decisions that follow differ (other
victims, other preemption counts), and repeats of one real run differ by as
much as the simulator does. An error within that spread is not the
simulator's to explain; the summary counts the figures whose error exceeds it.

Workloads of token ids (generators, token-id traces): ``compare``
has no tokenizer for text prompts.

Run from the repository root after ``make setup``::

    .venv/bin/python scripts/sim_vs_real.py run --threads 1 --repeat 3 --out real.json \\
        --workload "poisson:n=48,rate=3,..." --policy fcfs --policy priority+chunked \\
        --set kv_cache.num_blocks=24
    .venv/bin/python scripts/sim_vs_real.py compare real.json --profile before.json --profile both.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch

from cbcore.bench.driver import drive, warm_up
from cbcore.bench.metrics import summarize
from cbcore.bench.sources import load_workload
from cbcore.bench.stepcost import timed_steps
from cbcore.bench.suite import prompt_token_ids
from cbcore.cli.common import scheduler_from_mix
from cbcore.cli.main import opt_in_process_settings
from cbcore.cli.options_util import load_model
from cbcore.config import EngineConfig
from cbcore.engine import Engine
from cbcore.serve.config import Settings
from cbcore.sim.profile import load_profile
from cbcore.sim.shape import StepShape
from cbcore.sim.suite import simulate_suite

FIGURES = ("output_tokens_per_s", "ttft_mean_s", "ttft_p50_s", "ttft_p99_s", "tpot_mean_s", "e2e_mean_s", "e2e_p99_s")


def config_for(mix: str, overrides: list[str]) -> EngineConfig:
    return EngineConfig.from_dict({"scheduler": scheduler_from_mix(mix)}, overrides)


def run(args: argparse.Namespace) -> None:
    # The process `cb bench` and `cb profile` run in (freed memory kept for the next step): a real
    # run without it pays page faults in every wide step that the profile never measured.
    opt_in_process_settings()
    torch.set_num_threads(args.threads)
    configs = {mix: config_for(mix, args.set) for mix in args.policy}
    model, tokenizer = load_model(next(iter(configs.values())))
    workload = load_workload(args.workload, model.config.vocab_size)
    token_ids = prompt_token_ids(workload, tokenizer)
    runs: dict[str, list[dict[str, Any]]] = {mix: [] for mix in configs}
    for repeat in range(args.repeat):
        for mix, config in configs.items():
            engine = Engine(model, tokenizer, config)
            warm_up(engine, token_ids)
            with timed_steps(engine) as timed:
                result = drive([engine], mix, workload, token_ids)
            row = summarize(mix, workload.requests, result.outputs, result.duration_s, steps=result.steps)
            steps = [
                [s.num_seqs, s.prefill_tokens, s.decode_tokens, s.attn_pairs, s.kv_tokens, s.num_samples, t.total_s]
                for s, t in ((step.shape, step.stats) for step in timed)
            ]
            runs[mix].append({"figures": {k: row[k] for k in (*FIGURES, "preemptions", "steps")}, "steps": steps})
            print(f"repeat {repeat + 1}, {mix}: {result.duration_s:.1f} s, {row['preemptions']} preemptions")
            del engine
    out = {
        "workload": args.workload,
        "threads": args.threads,
        "configs": {mix: c.model_dump(mode="json") for mix, c in configs.items()},
        "runs": runs,
    }
    Path(args.out).write_text(json.dumps(out))


def priced(profile: Any, steps: list[list[float]], block_size: int) -> float:
    total = 0.0
    for n, p, d, a, k, r, _ in steps:
        shape = StepShape(int(n), int(p), int(d), int(a), int(k), tuple(range(int(r))))
        total += profile.step_time(shape, block_size)
    return total


def wider_note(profile: Any, mix: str, tries: list[dict[str, Any]]) -> str:
    """Real steps wider than any the profile timed: priced by extrapolation, the first suspect of a miss."""
    timed = getattr(profile.cost, "steps", None)
    if not timed:
        return ""
    widest = max(p + d for _, p, d, *_ in timed)
    wide = [sum(s[1] + s[2] > widest for s in t["steps"]) for t in tries]
    if not any(wide):
        return ""
    counts = "/".join(str(n) for n in wide)
    return f"`{mix}`: {counts} real steps wider than the profile's widest timed step ({widest} tokens)"


def compare(args: argparse.Namespace) -> None:
    real = json.loads(Path(args.real).read_text())
    for spec in args.profile:
        profile = load_profile(spec)
        workload = load_workload(real["workload"], profile.model.vocab_size)
        token_ids = prompt_token_ids(workload, None)
        errors: list[float] = []
        spreads: list[float] = []  # per figure: the real repeats' largest distance from their median
        beyond = 0  # figures whose error exceeds max(5 %, their real spread)
        notes: list[str] = []
        print(f"\n### profile {spec}\n")
        print("| mix | " + " | ".join(FIGURES) + " | preemptions | steps | real steps priced |")
        print("|---" * (len(FIGURES) + 4) + "|")
        for mix, tries in real["runs"].items():
            # Settings: a results file may hold the serve and router sections too (older ones do).
            config = Settings.model_validate(real["configs"][mix])
            sim = simulate_suite(profile, workload, token_ids, [(mix, config)]).rows[0]
            cells = []
            for key in FIGURES:
                runs = [t["figures"][key] for t in tries]
                value = statistics.median(runs)
                error, spread = sim[key] / value - 1, max(abs(r / value - 1) for r in runs)
                errors.append(abs(error))
                spreads.append(spread)
                beyond += abs(error) > max(0.05, spread)
                cells.append(f"{value:.3g} / {sim[key]:.3g} ({100 * error:+.1f} %, real ±{100 * spread:.0f} %)")
            pre = "/".join(str(t["figures"]["preemptions"]) for t in tries)
            steps = "/".join(str(t["figures"]["steps"]) for t in tries)
            prices = "/".join(
                f"{100 * (priced(profile, t['steps'], config.kv_cache.block_size) / sum(s[-1] for s in t['steps']) - 1):+.1f} %"
                for t in tries
            )
            cells += [f"{pre} / {sim['preemptions']}", f"{steps} / {sim['steps']}", prices]
            print(f"| `{mix}` | " + " | ".join(cells) + " |")
            notes.append(wider_note(profile, mix, tries))
        errors.sort()
        print("\n" + "\n".join(n for n in notes if n))
        print(
            f"\n{len(errors)} figures: median error {100 * statistics.median(errors):.1f} %, "
            f"largest {100 * errors[-1]:.1f} %, above 5 %: {sum(e > 0.05 for e in errors)}, "
            f"above 15 %: {sum(e > 0.15 for e in errors)}; the real runs' own spread: median "
            f"{100 * statistics.median(spreads):.1f} %, largest {100 * max(spreads):.1f} %; "
            f"errors beyond max(5 %, their figure's spread): {beyond}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="real runs, metrics and step shapes to JSON")
    r.add_argument("--workload", required=True)
    r.add_argument("--policy", action="append", required=True, metavar="MIX")
    r.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE")
    r.add_argument("--repeat", type=int, default=3)
    r.add_argument("--threads", type=int, default=torch.get_num_threads())
    r.add_argument("--out", required=True)
    c = sub.add_parser("compare", help="simulate the runs' workload and configs, and compare")
    c.add_argument("real")
    c.add_argument("--profile", action="append", required=True)
    args = parser.parse_args()
    run(args) if args.command == "run" else compare(args)


if __name__ == "__main__":
    main()
