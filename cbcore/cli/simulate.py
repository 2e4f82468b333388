"""`cb simulate`: a workload through the real scheduler and policies, on a measured or roofline cost model.

Every ``--config`` x ``--policy`` combination is one row, as in ``cb bench``,
and the table, JSON, CSV and plots are ``cb bench``'s. Requests end at their
``max_new_tokens`` (no tokens are computed, so EOS never comes).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from cbcore.cli.bench import add_report_flags, add_row_flags, check_replicates, parse_sweep
from cbcore.cli.main import CLIError

EPILOG = """\
profiles: a file written by `cb profile`; a measured GPU profile, named GPU-MODEL-tpN (Vidur's
  operator tables for linear and elementwise operators, the embedding and the all-reduce; attention
  by roofline, not validated; `cb profile --check` prints each one's held-out error):
{measured}
  (A40 at TP 1 only: its tables have no all-reduce), or vidur:gpu=G,model=M,tp=N[,network=dgx|
  pairwise-nvlink][,util=0.9] (pairwise NVLink: TP 2 and 4; util: share of GPU memory for weights
  and KV cache); or the roofline profile h200-llama-3-8b (no measured H200 table).
  Steps wider than a table (4,096 tokens; 32,768 for Llama-3) are extrapolated and counted per row
  (extrapolated_steps). See docs/simulate.md.

sweeps: --sweep KEY=V1,V2,... runs every row at each value of one workload key (one row per
  value x configuration; --plot draws each metric against the value); --jobs N simulates N points
  at once. Workload keys: see `cb bench --help` (deadlines=0:2/1:30 gives deadlines per priority).

a measured profile whose held-out fit error is above 25 % is refused (the machine was probably
  busy when it was timed); --force uses it anyway.

examples:
  cb simulate --profile h200-llama-3-8b --policy fcfs --policy edf --policy edf-demote \\
      --workload poisson:n=2000,priorities=0:1/1:3,deadlines=0:2/1:30 --sweep rate=2,3,4,5 --jobs 2 --plot sweep.png
  cb simulate --profile h200-llama-3-8b --policy fcfs --policy priority --policy vtc --policy sjf \\
      --workload poisson:n=10000,rate=40,burstiness=0.3,clients=a:3/b:1,priorities=0:3/1:1 \\
      --set scheduler.budget.max_num_seqs=256 --set scheduler.budget.max_num_batched_tokens=8192 --json sim.json
"""


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    parser = sub.add_parser(
        "simulate",
        parents=[common],
        conflict_handler="resolve",  # --config is repeatable here
        help="run policies on a simulated clock with a step cost model (cb profile)",
        description=__doc__.splitlines()[0],
        epilog=EPILOG.format(measured=_measured_names()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--profile", required=True, metavar="FILE_OR_NAME", help="cost profile")
    add_row_flags(parser)
    parser.add_argument(
        "--replicas", type=int, default=1, metavar="N", help="N engines per row behind the config's router"
    )
    parser.add_argument(
        "--router",
        action="append",
        default=[],
        dest="routers",
        metavar="NAME",
        help="with --replicas: one row per router, in place of the config's router (repeatable; "
        "default: the config's router)",
    )
    parser.add_argument(
        "--load-interval",
        type=float,
        default=0.5,
        metavar="S",
        help="seconds of virtual time between the load reports routers read (default 0.5)",
    )
    parser.add_argument(
        "--tokenizer", metavar="DIR", help="tokenizer for text prompts (default: the model's)"
    )
    parser.add_argument(
        "--jobs", type=int, default=1, metavar="N",
        help="with --sweep, --replicates or --capacity: simulate N runs at once in worker processes"
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="use a measured profile even when its held-out fit error is above the threshold (25 %%)",
    )
    add_report_flags(parser)
    parser.set_defaults(func=run, backends=[], runs_model=False)  # no backend to check (nor torch to load)


def run(args: argparse.Namespace) -> int:
    from functools import partial

    from cbcore.bench.driver import no_progress
    from cbcore.bench.sources import load_workload
    from cbcore.cli.bench import build_configs, progress_factory, run_rows
    from cbcore.sim.profile import load_profile
    from cbcore.sim.suite import simulate_workload

    profile = load_profile(args.profile)
    problem = profile.unreliable(
        f"profile {args.profile}",
        "run `cb profile` again when the machine is quiet, or pass --force to simulate with it anyway",
    )
    if problem is not None and not args.force:
        raise CLIError(problem)
    sweep = parse_sweep(args)
    if args.jobs < 1:
        raise CLIError(f"--jobs must be at least 1, got {args.jobs}")
    if args.jobs > 1 and sweep is None and args.replicates == 1 and not args.capacity:
        raise CLIError(
            "--jobs runs the points of a --sweep, the --replicates or the --capacity searches in parallel; "
            "without them there is one point"
        )
    slo = check_replicates(args)
    configs = build_configs(args)
    if args.replicas < 1:
        raise CLIError(f"--replicas must be at least 1, got {args.replicas}")
    if args.routers:
        if args.replicas == 1:
            raise CLIError("--router needs --replicas N with N > 1 (one engine has nothing to route)")
        configs = with_routers(configs, args.routers)
    context = configs[0][1].model.max_model_len or profile.model.max_position_embeddings
    draw = partial(load_workload, vocab_size=profile.model.vocab_size, context=context)
    # Replicate 0 (the others are drawn later); a capacity search draws each rate's workload itself.
    workload = None if sweep is not None or args.capacity else draw(args.workload)
    tokenizer = None
    if workload is not None and any(r.is_text for r in workload.requests):
        tokenizer = _tokenizer(args.tokenizer, configs[0][1].model.path)
    p = profile.identity
    print(f"simulated: {p.model} ({p.dtype}, {p.backend}) on {p.hardware}, {p.source} profile", file=sys.stderr)
    if problem is not None:
        print(f"cb: warning: {problem.split(';')[0]}; used anyway (--force)", file=sys.stderr)
    # Worker processes draw no progress bars: several bars on one terminal garble each other.
    progress = no_progress if args.jobs > 1 else progress_factory(args.no_progress)
    suite = partial(
        simulate_workload, profile, tokenizer=tokenizer, slo=slo, progress=progress,
        replicas=args.replicas, load_interval_s=args.load_interval,
    )  # fmt: skip
    return run_rows(args, "cb simulate", sweep, configs, suite, draw, workload, jobs=args.jobs)


def _measured_names() -> str:
    """The measured profiles, a few per line, for the help text."""
    from cbcore.sim.gpu.catalog import summary

    names, lines = summary(), []
    for i in range(0, len(names), 3):
        lines.append("    " + "  ".join(f"{n:30}" for n in names[i : i + 3]).rstrip())
    return "\n".join(lines)


def with_routers(configs: list[tuple[str, Any]], routers: list[str]) -> list[tuple[str, Any]]:
    """Each row once per router, named ``row router``."""
    from cbcore.cli.main import one_line
    from cbcore.config import ConfigError
    from cbcore.plugins import PluginError, did_you_mean, get_registry
    from cbcore.serve.config import Settings

    rows = []
    for name, config in configs:
        known = sorted(e.name for e in get_registry(tuple(config.plugins)).entries() if e.kind == "router")
        replaced = config.router.name
        if "router" in config.model_fields_set:
            print(
                f"cb: note: --router replaces the config's router {replaced!r} in row {name!r}", file=sys.stderr
            )
        for router in routers:
            if router not in known:
                raise CLIError(f"--router {router}: unknown router{did_you_mean(router, known)}; known: {', '.join(known)}")
            try:
                cfg = Settings.model_validate({**config.model_dump(exclude_unset=True), "router": {"name": router}})
            except (ValueError, ConfigError, PluginError) as exc:
                raise CLIError(f"--router {router}: {one_line(exc)}") from None
            rows.append((f"{name} {router}" if len(configs) > 1 else router, cfg))
    return rows


def _tokenizer(path: str | None, model_path: str | None) -> Any:
    """Text prompts are encoded as the engine would: with the tokenizer of the model (default: SmolLM2)."""
    from transformers import AutoTokenizer

    if path is None and model_path is None:
        from cbcore.models.default_model import default_model_dir

        try:
            path = str(default_model_dir())
        except Exception as exc:
            raise CLIError(f"text prompts need a tokenizer: pass --tokenizer DIR ({exc})") from None
    return AutoTokenizer.from_pretrained(path or model_path)
