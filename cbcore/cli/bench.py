"""`cb bench`: one workload through several configurations and baselines, side by side.

Every ``--config`` x ``--policy`` x ``--backend`` combination is one row (the
flags that are not given do not multiply); ``--baseline`` adds outside
baselines on the same requests. All rows run in this process on one model,
except ``--server URL`` rows (a running `cb serve`, driven over HTTP with
streaming clients; with ``--server`` alone no in-process row runs, as it would
share the machine with the server) and, with ``--serve``, one extra row per
configuration served by a `cb serve` subprocess started for it
(``NAME@http``): the same trace in process and over the wire, side by side.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from cbcore.cli.main import CLIError
from cbcore.cli.rows import build_configs, check_replicates

EPILOG = """\
workloads:
  seed                                  the seeds' six requests (caps 6..300), all at t=0
  FILE.jsonl                            a trace (see --save-trace), replayed exactly
  azure-conv-2023, mooncake-conversation
                                        production traces shipped with cbcore (one hour each; options
                                        after a colon: azure-conv-2023:rate=5,duration_s=600)
  trace:path=FILE[,key=value...]        an Azure CSV (TIMESTAMP, ContextTokens, GeneratedTokens), a Mooncake
                                        JSONL (timestamp, input_length, output_length, hash_ids), a Vidur CSV
                                        (arrived_at, num_prefill_tokens, num_decode_tokens) or a cbcore JSONL,
                                        detected by its columns (gzip or not)
      keys: time_scale (multiply arrival offsets) or rate (req/s, rescales the arrivals), start_s,
      duration_s, limit (a window: trace seconds, first N rows), length_scale, max_input, max_output
      (default: the model's context holds prompt + output), overlong (drop or clip; counted in the
      report), seed (prompt token ids), clients, priorities, deadlines, deadline_spread (drawn per row)
  poisson:n=64,rate=2,lengths=sharegpt,seed=0
      keys: n, rate (req/s, inf = all at t=0), burstiness (1 = Poisson), lengths (fixed, uniform,
      sharegpt, or arxiv-summarization: Sarathi-Serve's measured (prompt, output) pairs), input_len, output_len (means), range_ratio, sigma, max_input, max_output,
      clients (a:3/b:1), priorities (0:1/1:3), ignore_eos, seed,
      deadlines (mean deadline_s per priority class, 0:2/1:30; classes not named get none),
      deadline_spread (each deadline drawn uniformly in mean * [1 - s, 1 + s], default 0.5;
      a request met its deadline when it completed with end-to-end latency <= deadline_s),
      system_len (tokens of a shared system prompt), system_prompts (distinct ones, by client),
      turns (per conversation: turn k+1 = turn k + its answer + new text, sent think_s after the answer)

sweeps:
  --sweep KEY=V1,V2,...                 every row at each value of one generator key: one row per
                                        value x configuration (JSON rows carry sweep_key, sweep_value),
                                        and --plot draws each metric against the value

example:
  cb bench --workload seed --policy fcfs --policy priority+chunked --backend eager --backend sdpa \\
      --baseline hf-static --baseline hf-generate-batch --json out.json --plot out.png
"""


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    parser = sub.add_parser(
        "bench",
        parents=[common],
        conflict_handler="resolve",  # --config is repeatable here
        help="compare policies, backends and baselines on one workload",
        description=__doc__.splitlines()[0],
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_row_flags(parser)
    parser.add_argument("--backend", action="append", default=[], dest="backends", metavar="NAME")
    parser.add_argument(
        "--baseline",
        action="append",
        default=[],
        dest="baselines",
        choices=["hf-static", "hf-generate-batch", "seed-toy"],
        help="add an outside baseline row (repeatable)",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        metavar="N",
        help="baselines' batch (hf-static wave size, hf-generate-batch max requests per batch); "
        "default: the largest max_num_seqs among the configurations (hf-generate-batch also gets "
        "their largest max_num_batched_tokens)",
    )
    parser.add_argument(
        "--server",
        action="append",
        default=[],
        dest="servers",
        metavar="URL",
        help="add a row driving a running `cb serve` at URL over HTTP (repeatable)",
    )
    parser.add_argument(
        "--serve",
        action="store_true",
        help="also run every configuration behind a `cb serve` subprocess (rows NAME@http)",
    )
    parser.add_argument("--api-key", metavar="KEY", help="API key for --server (default: $CBCORE_API_KEY)")
    add_report_flags(parser)
    parser.add_argument(
        "--no-reference",
        action="store_true",
        help="skip the per-prompt reference (identical_to_reference: null)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="N",
        help="run every row N times, interleaved, and report each row's median run",
    )
    parser.add_argument("--threads", type=int, metavar="N", help="torch CPU threads")
    parser.set_defaults(func=run)


def add_row_flags(parser: argparse.ArgumentParser) -> None:
    """The workload and the rows, shared with `cb simulate`: one row per --config x --policy."""
    parser.add_argument(
        "--workload", default="seed", metavar="SPEC",
        help="seed, FILE.jsonl, poisson:..., a trace (trace:path=FILE,...; azure-conv-2023; mooncake-conversation)",
    )  # fmt: skip
    parser.add_argument(
        "--config", action="append", default=[], dest="configs", metavar="FILE", help="engine config (repeatable)"
    )
    parser.add_argument(
        "--policy",
        action="append",
        default=[],
        dest="policies",
        metavar="MIX",
        help="one row per --policy: a mix such as priority+chunked, with per-row parameters "
        "'sjf(aging_s=0.5)+chunked(chunk_size=512)' and the phase order (decode-first, prefill-first); "
        "NAME=MIX names the row; @FILE takes the row's scheduler section from a config file",
    )
    parser.add_argument(
        "--sweep",
        metavar="KEY=V1,V2,...",
        help="run every row at each value of one workload key (e.g. rate=2,3,4,5); --plot then draws "
        "each metric against the value",
    )
    parser.add_argument(
        "--capacity",
        action="append",
        default=[],
        metavar="SLO",
        help="search each row's capacity (repeatable: each row under each SLO): the highest rate= meeting SLO, 'sarathi:tbt=MS[,delay=MS]' (P99 time "
        "between tokens, median scheduling delay, default 2000 ms) or 'attainment:p=PCT,ttft=MS,tpot=MS'; "
        "search keys start=, tol= (default 0.05), min_rate=, max_rate=, max_runs=",
    )
    parser.add_argument(
        "--replicates",
        type=int,
        default=1,
        metavar="N",
        help="run every row on N independently drawn workloads (a generator's seed + i, or a trace's next "
        "duration_s window) and report each metric as mean ± the half-width of its 95 %% interval",
    )


def add_report_flags(parser: argparse.ArgumentParser) -> None:
    """Where the results go, shared with `cb simulate` (see :func:`write_reports`)."""
    parser.add_argument("--slo", metavar="ttft:MS,tpot:MS", help="latency objectives for goodput")
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")
    parser.add_argument("--csv", metavar="FILE", help="write the rows as CSV")
    parser.add_argument("--plot", metavar="FILE.png", help="latency CDFs and throughput per row")
    parser.add_argument("--save-trace", metavar="FILE.jsonl", help="write the workload as a replayable trace")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def write_reports(result: Any, args: argparse.Namespace, command: str) -> None:
    """The table on stdout, then the files the report flags asked for (plots titled by ``command``)."""
    from cbcore.bench import report

    capacity = "capacity" in result.workload
    if capacity:
        from cbcore.bench.capacity_report import capacity_table

        print(capacity_table(result))
    else:
        print(report.table(result))
    if args.json:
        report.write_json(result, args.json)
    if args.csv:
        report.write_csv(result, args.csv)
    if args.plot and capacity:
        from cbcore.bench.capacity_report import plot_capacity

        plot_capacity(result, args.plot, command)
    elif args.plot and "sweep" in result.workload:
        from cbcore.bench.sweep_report import plot_sweep

        plot_sweep(result, args.plot, command)
    elif args.plot:
        report.plot(result, args.plot, command)


def parse_sweep(args: argparse.Namespace) -> Any:
    """The ``--sweep`` of the arguments, its points checked against the workload; None without one."""
    from cbcore.bench.sweep import Sweep

    if args.sweep is None:
        return None
    if args.save_trace:
        raise CLIError("--save-trace with --sweep: each value draws another workload; save one point at a time")
    sweep = Sweep.parse(args.sweep)
    sweep.points(args.workload)
    return sweep


def run(args: argparse.Namespace) -> int:
    from cbcore.bench.sources import load_workload, needs_vocabulary
    from cbcore.bench.suite import baseline_limits, run_suite

    if args.threads is not None:
        if args.threads < 1:
            raise CLIError(f"--threads must be >= 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
    if args.batch_size is not None and args.batch_size < 1:
        raise CLIError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.repeat < 1:
        raise CLIError(f"--repeat must be >= 1, got {args.repeat}")
    slo = check_replicates(args)
    sweep = parse_sweep(args)
    # A trace or spec is checked before the (slow) model load; drawing prompts needs the vocabulary.
    workload = None if needs_vocabulary(args.workload) else load_workload(args.workload)
    configs = build_configs(args)
    local = configs
    if args.servers and not (args.configs or args.policies or args.backends):
        local = []  # the servers are what is measured; an in-process row beside them would share their cores
        print("cb: note: --server: no in-process row (give --policy, --config or --backend to add one)",
              file=sys.stderr)  # fmt: skip
    batch_size, batch_tokens = baseline_limits(configs)
    batch_size = args.batch_size or batch_size

    from cbcore.models.loading import load_model_and_tokenizer

    model_cfg = configs[0][1].model
    model, tokenizer = load_model_and_tokenizer(model_cfg.path, model_cfg)
    vocab = model.config.get_text_config().vocab_size
    if tokenizer is not None:
        vocab = min(vocab, len(tokenizer))
    special = list(getattr(tokenizer, "all_special_ids", []) or [])
    with contextlib.ExitStack() as stack:
        servers = [(f"http:{url}", url) for url in args.servers]
        if args.serve:
            servers += start_servers(stack, configs, args.threads)
        suite = partial(
            run_suite,
            model,
            tokenizer,
            baselines=args.baselines,
            batch_size=batch_size,
            batch_tokens=batch_tokens,
            slo=slo,
            reference=not (args.no_reference or args.capacity),  # a search's many runs are not checked
            repeat=args.repeat,
            progress=progress_factory(args.no_progress),
            servers=servers,
            api_key=args.api_key or os.environ.get("CBCORE_API_KEY"),
        )
        context = model_cfg.max_model_len or getattr(model.config.get_text_config(), "max_position_embeddings", None)
        draw = partial(load_workload, vocab_size=vocab, special_ids=special, context=context)
        return run_rows(args, "cb bench", sweep, local, suite, draw, workload)


def run_rows(
    args: argparse.Namespace,
    command: str,
    sweep: Any,
    configs: list[tuple[str, Any]],
    suite: Callable[[Any, list[tuple[str, Any]]], Any],
    draw: Callable[[str], Any],
    workload: Any = None,
    jobs: int = 1,
) -> int:
    """Every row on the workload, or on every point of the sweep, through ``suite``; then the reports.

    ``draw`` makes a workload from its spec (``workload``, when given, is the
    one already read); with ``jobs`` > 1 the points run in worker processes.
    Returns the exit status: 1 when a row failed.
    """
    from cbcore.bench.replicates import combine, method, replicate_specs
    from cbcore.bench.sweep import draw_points, merge, run_specs

    specs = replicate_specs(args.workload, args.replicates)
    if args.capacity:
        from cbcore.bench.capacity import Objective, run_capacity

        kind = "simulated" if command == "cb simulate" else "cbcore"
        objectives = [Objective.parse(text) for text in args.capacity]
        result = run_capacity(specs, configs, suite, draw, objectives, kind=kind, jobs=jobs)
        if len(specs) > 1:
            result.workload["capacity"]["method"] = method(args.workload, len(specs))
        write_reports(result, args, command)
        return 1 if any("error" in row for row in result.rows) else 0
    if sweep is None:
        workload = workload if workload is not None else draw(args.workload)
        if args.save_trace:
            workload.save(args.save_trace)
        workloads = [workload, *[None] * (len(specs) - 1)]
        results = run_specs(specs, configs, suite, jobs=jobs, draw=draw, workloads=workloads)
    else:
        per_replicate = [draw_points(sweep, spec, draw) for spec in specs]
        flat = [p for points in per_replicate for p in points]
        parts = run_specs([p.spec for p in flat], configs, suite, jobs=jobs, draw=draw,
                          workloads=[p.workload for p in flat])  # fmt: skip
        k = len(sweep.values)
        results = [merge(sweep, points, parts[i * k : (i + 1) * k]) for i, points in enumerate(per_replicate)]
    result = results[0] if len(results) == 1 else combine(results, specs)
    write_reports(result, args, command)
    for row in result.rows:
        for note in row.get("notes", ()):
            print(f"cb: note: {row['name']}: {note}", file=sys.stderr)
    return 1 if any("error" in row for row in result.rows) else 0


def start_servers(
    stack: contextlib.ExitStack, configs: list[tuple[str, Any]], threads: int | None
) -> list[tuple[str, str]]:
    """One `cb serve` subprocess per configuration, stopped when ``stack`` closes."""
    from cbcore.serve.launch import ServerProcess

    servers = []
    tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="cb-bench-serve-")))
    for i, (name, config) in enumerate(configs):
        path = tmp / f"config-{i}.json"
        path.write_text(config.model_dump_json(exclude_unset=True))
        flags = ["--config", str(path)] + (["--threads", str(threads)] if threads else [])
        server = stack.enter_context(ServerProcess(flags))
        servers.append((f"{name}@http", server.url))
    return servers


def progress_factory(disabled: bool) -> Any:
    from tqdm import tqdm

    def make(total: int, desc: str) -> Any:
        return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, disable=disabled, dynamic_ncols=True)

    return make
