"""One workload through every row, side by side: the suite of `cb bench` and `cb simulate`.

A row is anything that turns the workload into a :class:`RunResult` (an
engine driven by :func:`cbcore.bench.driver.drive` on wall or virtual time, a
server over HTTP, an outside baseline); :func:`run_rows` runs the rows and
summarises each with the same metrics. :func:`run_suite` makes the rows of
`cb bench`: all share one model object and the same token ids, and each engine
is built, warmed up with a short request, timed on the workload, and released
before the next, so rows do not compete for memory or CPU. The model-side
modules (engine, baselines, references) are imported where they are used, so
that `cb simulate`, which needs only the rows, never loads transformers. The per-prompt
reference (HF ``generate`` on each prompt alone) is computed once and every
row is compared with it. `cb simulate`'s rows are :mod:`cbcore.sim.suite`'s.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Any

from cbcore.bench.classes import deadline_stats, per_class
from cbcore.bench.driver import ProgressFactory, RunResult, drive, no_progress, warm_up
from cbcore.bench.memory import PeakRSS, process_peak_rss_bytes
from cbcore.bench.metrics import SLO, latency_samples, summarize
from cbcore.bench.saturation import keeps_up
from cbcore.bench.workload import BenchRequest, Workload
from cbcore.config import EngineConfig
from cbcore.log import get_logger
from cbcore.outputs import RequestOutput

if TYPE_CHECKING:
    import torch

    from cbcore.testing.reference import ReferenceOutput

log = get_logger(__name__)


@dataclass
class BenchResult:
    workload: dict[str, Any]
    rows: list[dict[str, Any]]
    # Per row name: latency samples (ttft, tpot, itl, e2e, queue) for the CDF plots.
    samples: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    # With replicates: per row name, each replicate's samples (``samples`` pools them), for the plots' bands.
    replicate_samples: dict[str, list[dict[str, list[float]]]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"workload": self.workload, "rows": self.rows}


def prompt_token_ids(workload: Workload, tokenizer: Any | None, lazy: bool = False) -> list[Seq[int]]:
    """Every request's prompt ids; with ``lazy``, synthetic prompts stay recipes until a run reads them
    (the simulator's way through a trace of millions of prompt tokens)."""
    if lazy:
        return [r.lazy_token_ids(tokenizer) for r in workload.requests]
    return [r.token_ids(tokenizer) for r in workload.requests]


def reference_outputs(
    model: torch.nn.Module,
    workload: Workload,
    token_ids: Seq[Seq[int]],
    progress: ProgressFactory = no_progress,
) -> list[ReferenceOutput]:
    """HF ``generate`` on each prompt alone (EOS ignored where the request ignores it)."""
    from cbcore.testing.reference import reference_generate

    bar = progress(len(workload), "reference")
    refs = []
    for req, ids in zip(workload.requests, token_ids, strict=True):
        refs.extend(reference_generate(model, [ids], [req.max_new_tokens], ignore_eos=req.ignore_eos))
        bar.update(1)
    bar.close()
    return refs


class References:
    """HF ``generate`` on each prompt alone, computed once per distinct prompt and cap.

    For an open-loop workload every row sends the same prompts. In a closed
    loop a follow-up turn's prompt holds the previous answer, so it is read from
    each run's outputs: when every turn is exact, every row asks the same.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._cache: dict[tuple[tuple[int, ...], int, bool], ReferenceOutput] = {}

    def get(self, prompt: Seq[int], req: BenchRequest) -> ReferenceOutput:
        key = (tuple(prompt), req.max_new_tokens, req.ignore_eos)
        if key not in self._cache:
            from cbcore.testing.reference import reference_generate

            (ref,) = reference_generate(
                self.model, [list(prompt)], [req.max_new_tokens], ignore_eos=req.ignore_eos
            )
            self._cache[key] = ref
        return self._cache[key]

    def for_run(self, workload: Workload, outputs: Seq[RequestOutput]) -> list[ReferenceOutput]:
        return [self.get(o.prompt_token_ids, r) for r, o in zip(workload.requests, outputs, strict=True)]


def reference_check(
    model: torch.nn.Module, workload: Workload, refs: Seq[ReferenceOutput] | References, tries: Seq[RunResult]
) -> dict[str, Any]:
    """Every run against the per-prompt reference; the row reports its worst run."""
    from cbcore.testing.compare import compare_greedy

    checks = []
    for run in tries:
        expected = refs.for_run(workload, run.outputs) if isinstance(refs, References) else refs
        report = compare_greedy(model, run.outputs, expected)
        checks.append({
            "identical_to_reference": report.num_identical == len(report.comparisons),
            "reference_near_ties": report.num_near_ties,
            "reference_diverged": report.num_diverged,
            "reference_mismatches": [c.describe() for c in report.comparisons if not c.identical][:10],
        })  # fmt: skip
    return min(checks, key=lambda c: (c["identical_to_reference"], -c["reference_diverged"]))


@dataclass(frozen=True)
class Row:
    """One row of a result: its name, the kind of run it is, and how to run it once."""

    name: str
    kind: str  # "cbcore", "simulated" or "baseline"
    run: Callable[[], RunResult]


#: What a reference check adds to a row, from every run of it (see :func:`reference_check`).
Check = Callable[[Seq[RunResult]], dict[str, Any]]


def run_rows(
    workload: Workload, rows: Seq[Row], *, repeat: int = 1, slo: SLO | None = None, check: Check | None = None
) -> BenchResult:
    """Every row on ``workload``, in the order given; the one suite of `cb bench` and `cb simulate`.

    With ``repeat`` > 1 every row runs that many times and reports its median run
    (by duration). Repetitions are interleaved (all rows, then all rows again) so
    that a change in machine load during the benchmark hits every row alike. A row
    that fails is reported with its error; every other row still runs.
    """
    check_rows([row.name for row in rows], repeat)
    runs: dict[str, list[RunResult]] = {row.name: [] for row in rows}
    errors: dict[str, str] = {}
    for _ in range(repeat):
        for row in rows:
            if row.name in errors:
                continue
            try:
                runs[row.name].append(row.run())
            except Exception as exc:
                errors[row.name] = one_line(exc)
                log.error("benchmark row failed", row=row.name, error=errors[row.name])
                gc.collect()
    results = []
    samples = {}
    for row in rows:
        if row.name in errors:
            results.append({"name": row.name, "kind": row.kind, "error": errors[row.name]})
            continue
        results.append(summarize_runs(workload, runs[row.name], slo, check))
        samples[row.name] = latency_samples(_median_run(runs[row.name]).outputs)
    return BenchResult(workload=workload.describe(), rows=results, samples=samples)


def check_rows(names: Seq[str], repeat: int) -> None:
    if len(set(names)) != len(names):
        raise ValueError(f"two rows share a name: {names}")
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")


def run_suite(
    model: torch.nn.Module,
    tokenizer: Any | None,
    workload: Workload,
    configs: Seq[tuple[str, EngineConfig]],
    *,
    baselines: Seq[str] = (),
    batch_size: int = 16,
    batch_tokens: int = 512,
    slo: SLO | None = None,
    reference: bool = True,
    repeat: int = 1,
    progress: ProgressFactory = no_progress,
    servers: Seq[tuple[str, str]] = (),
    api_key: str | None = None,
) -> BenchResult:
    """Run every configuration and baseline on ``workload`` in this process; one row each, in the order given.

    ``servers`` are (row name, URL) pairs: each row drives a running `cb serve`
    over HTTP with streaming clients (:mod:`cbcore.bench.http_driver`).
    """
    from cbcore.bench.baselines import BASELINES, run_hf_generate_batch, run_hf_static
    from cbcore.bench.http_driver import run_http
    from cbcore.bench.seed_toy import run_seed_toy

    unknown = [b for b in baselines if b not in BASELINES]
    if unknown:
        raise ValueError(f"unknown baseline {unknown[0]!r}; known: {', '.join(BASELINES)}")
    check_rows([n for n, _ in configs] + [n for n, _ in servers] + list(baselines), repeat)
    token_ids = prompt_token_ids(workload, tokenizer)
    refs: Seq[ReferenceOutput] | References | None = None
    if reference and workload.is_closed_loop:
        refs = References(model)  # prompts are known only once the previous turns have run
    elif reference:
        log.info("computing the per-prompt reference", requests=len(workload))
        refs = reference_outputs(model, workload, token_ids, progress)
    _warm_model(model, token_ids)
    rows = [
        Row(name, "cbcore", partial(_run_config, model, tokenizer, name, config, workload, token_ids, progress))
        for name, config in configs
    ]
    rows += [
        Row(name, "cbcore", partial(run_http, url, name, workload, token_ids, api_key=api_key, progress=progress))
        for name, url in servers
    ]
    for name in baselines:
        limits = {"batch_size": batch_size}
        if name == "hf-generate-batch":
            limits["batch_tokens"] = batch_tokens
        baseline = {"hf-static": run_hf_static, "hf-generate-batch": run_hf_generate_batch}.get(name, run_seed_toy)
        run = partial(baseline, model, workload, token_ids, progress=progress, **limits)
        rows.append(Row(name, "baseline", run))
    check = None if refs is None else partial(reference_check, model, workload, refs)
    measured = [replace(row, run=partial(_measured, row.run)) for row in rows]
    result = run_rows(workload, measured, repeat=repeat, slo=slo, check=check)
    result.workload["process_peak_rss_mb"] = process_peak_rss_bytes() / 2**20
    return result


def _measured(run: Callable[[], RunResult]) -> RunResult:
    """One run, with the peak resident memory of the process while it ran."""
    with PeakRSS() as rss:
        result = run()
    result.info["rss_peak_mb"] = None if rss.peak_bytes is None else rss.peak_bytes / 2**20
    return result


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _run_config(
    model: torch.nn.Module,
    tokenizer: Any | None,
    name: str,
    config: EngineConfig,
    workload: Workload,
    token_ids: Seq[Seq[int]],
    progress: ProgressFactory,
) -> RunResult:
    """A fresh engine per run, warmed up, then released (each holds its own KV pool)."""
    from cbcore.engine import Engine

    engine = Engine(model, tokenizer, config)
    warm_up(engine, token_ids)
    run = drive([engine], name, workload, token_ids, progress=progress)
    run.info = {
        "backend": config.backend.name,
        "scheduler": config.scheduler.model_dump(exclude_defaults=True) or "default",
        "max_num_seqs": budget_limit(config, "max_num_seqs"),
        "kv_pool_mb": engine.runner.kv_cache.nbytes / 2**20,
        "kv_blocks": engine.runner.kv_cache.num_blocks,
    }
    del engine
    gc.collect()
    return run


def _median_run(tries: Seq[RunResult]) -> RunResult:
    ordered = sorted(tries, key=lambda r: r.duration_s)
    return ordered[(len(ordered) - 1) // 2]


def summarize_runs(
    workload: Workload, tries: Seq[RunResult], slo: SLO | None, check: Check | None
) -> dict[str, Any]:
    """A row from a configuration's runs: its median run's metrics, and what ``check`` says of every run."""
    run = _median_run(tries)
    row = summarize(
        run.name, workload.requests, run.outputs, run.duration_s, steps=run.steps, busy_s=run.busy_s, slo=slo
    )
    row = {"name": run.name, "kind": run.kind, **run.info, **row}
    row.update(deadline_stats(workload.requests, run.outputs))
    row.update(keeps_up(workload.requests, run.outputs))
    row["classes"] = per_class(workload.requests, run.outputs, slo)
    for failure in row["failures"]:
        log.warning(
            "requests did not complete", row=run.name, count=failure["count"], reason=failure["example"],
            requests=failure["requests"],
        )  # fmt: skip
    if len(tries) > 1:
        row["repeats"] = len(tries)
        row["duration_s_all"] = [t.duration_s for t in tries]
    row["identical_to_reference"] = None
    if check is not None:
        row.update(check(tries))
    return row


def budget_limit(config: EngineConfig, key: str) -> int | None:
    """A budget policy parameter (``max_num_seqs``, ``max_num_batched_tokens``), defaults included."""
    from cbcore.plugins import get_registry

    sched = config.scheduler
    if sched.name is not None:
        return None
    params = get_registry(tuple(config.plugins)).params_for(
        "budget", sched.budget.name, sched.budget.params, "scheduler.budget"
    )
    return getattr(params, key, None)


def baseline_limits(configs: Seq[tuple[str, EngineConfig]]) -> tuple[int, int]:
    """Batch size and tokens per step for the baselines: the largest among the configurations."""
    seqs = [n for n in (budget_limit(c, "max_num_seqs") for _, c in configs) if n is not None]
    tokens = [n for n in (budget_limit(c, "max_num_batched_tokens") for _, c in configs) if n is not None]
    return max(seqs, default=16), max(tokens, default=512)


def _warm_model(model: torch.nn.Module, token_ids: Seq[Seq[int]]) -> None:
    """One plain forward, so the process's first-call costs (allocator, kernels) are not timed."""
    import torch

    device = next(model.parameters()).device
    with torch.inference_mode():
        model(input_ids=torch.tensor([list(token_ids[0][:16])], device=device))
