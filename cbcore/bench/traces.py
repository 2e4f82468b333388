"""Production traces as workloads: ``trace:path=FILE,...`` and the shipped traces by name.

``--workload trace:path=FILE[,key=value...]`` reads any file of the formats
in :mod:`cbcore.bench.trace_formats`; ``--workload azure-conv-2023`` and
``--workload mooncake-conversation`` are the two traces shipped with cbcore
(``cbcore/bench/data``, with their licences), and take the same keys after a
colon (``azure-conv-2023:rate=5,duration_s=600``). In order:

1. **window** (in the trace's own time, seconds after its first request):
   ``start_s``, ``duration_s``, then the first ``limit`` rows of it;
2. **lengths**: ``length_scale`` multiplies prompt and output lengths (and
   Mooncake's block length, so the shared share of each prompt stays);
3. **the length rule**: a request whose prompt is over ``max_input``, whose
   output is over ``max_output``, or whose prompt plus output is over the
   model's context is ``overlong``; ``overlong=drop`` (default) leaves it
   out, ``overlong=clip`` cuts the prompt to ``max_input``, the output to
   ``max_output``, and then the prompt to what the context leaves (Vidur's
   trace-replay rule). Either way the count is in the workload's description
   (``trace.length_rule``) and in a line of the report;
4. **time**: ``time_scale=F`` multiplies every arrival offset by ``F``
   (2: half the rate), or ``rate=R`` scales them so that the workload's mean
   rate (requests over the span of their arrivals) is ``R``; not both;
5. **classes**: the traces have none, so ``priorities=``, ``clients=`` and
   ``deadlines=`` draw them per row as a generator does (seeded by row, so a
   request keeps its class in every window).

Prompts are :class:`~cbcore.bench.synthetic.SyntheticPrompt` records: drawn
from ``seed`` over the model's vocabulary without its special ids when a run
needs them; Mooncake's ``hash_ids`` become shared blocks. Requests are
greedy with ``ignore_eos``, so each produces the trace's output length, and
are named ``r<ROW>`` by their row in the file.
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import Field, ValidationError, model_validator

from cbcore.bench.generator import ClassSpec, arrival_times, spec_items
from cbcore.bench.synthetic import SyntheticPrompt, blocks_for
from cbcore.bench.trace_formats import TraceRows, read_trace
from cbcore.bench.workload import BenchRequest, Workload, WorkloadError
from cbcore.cli.config_files import format_validation_error
from cbcore.log import get_logger

log = get_logger(__name__)

#: The traces shipped inside the package (cbcore/bench/data; licences and sources in its README).
NAMED_TRACES = {
    "azure-conv-2023": "azure-conv-2023.csv.gz",
    "mooncake-conversation": "mooncake-conversation.jsonl.gz",
}
TRACE_KINDS = ("trace", *NAMED_TRACES)


class TraceSpec(ClassSpec):
    """``trace:path=FILE,key=value,...`` (or a shipped trace's name); every key but ``path`` has a default."""

    path: str = Field(min_length=1, description="The trace file (any known format, gzip or not).")
    time_scale: float | None = Field(None, gt=0, allow_inf_nan=False, description="Multiply arrival offsets by F.")
    rate: float | None = Field(None, gt=0, allow_inf_nan=False, description="Scale arrivals to this mean req/s.")
    start_s: float = Field(0.0, ge=0, allow_inf_nan=False, description="Window start, trace seconds.")
    duration_s: float | None = Field(None, gt=0, allow_inf_nan=False, description="Window length, trace seconds.")
    limit: int | None = Field(None, ge=1, description="At most the window's first N rows.")
    length_scale: float = Field(1.0, gt=0, allow_inf_nan=False, description="Multiply prompt and output lengths.")
    max_input: int | None = Field(None, ge=1, description="Longest prompt (default: the model's context).")
    max_output: int | None = Field(None, ge=1, description="Longest output (default: the model's context).")
    overlong: Literal["drop", "clip"] = Field("drop", description="What happens to a request over a limit.")
    seed: int = Field(0, ge=0, lt=2**63, description="Seed of the prompts' token ids (and of drawn classes).")

    @model_validator(mode="after")
    def _one_time_rule(self) -> TraceSpec:
        if self.rate is not None and self.time_scale is not None:
            raise ValueError("give rate= or time_scale=, not both (each sets the arrival times)")
        return self

    @property
    def draws_classes(self) -> bool:
        return bool({"clients", "priorities", "deadlines"} & self.model_fields_set)


#: Every key a trace spec takes (what ``--sweep`` may vary).
TRACE_KEYS = tuple(TraceSpec.model_fields)


def is_trace(spec: str) -> bool:
    """``trace:...`` or a shipped trace's name (options not yet checked)."""
    return spec.strip().partition(":")[0] in TRACE_KINDS


def shipped_path(name: str) -> Path:
    """Where a shipped trace lies inside the installed package."""
    return Path(str(resources.files("cbcore.bench") / "data" / NAMED_TRACES[name]))


def parse_trace_spec(spec: str) -> tuple[str, TraceSpec]:
    """``azure-conv-2023:rate=5`` or ``trace:path=F,limit=100`` -> (display name, validated spec)."""
    kind, _, body = spec.strip().partition(":")
    if kind not in TRACE_KINDS:
        raise WorkloadError(f"workload {spec!r}: not a trace; known: trace:path=FILE, {', '.join(NAMED_TRACES)}")
    data = spec_items(spec, body)
    if kind != "trace":
        if "path" in data:
            raise WorkloadError(f"workload {spec!r}: {kind} is a shipped trace; path= is for trace:path=FILE")
        data["path"] = str(shipped_path(kind))
    elif "path" not in data:
        raise WorkloadError(f"workload {spec!r}: trace needs path=FILE (or a shipped trace: {', '.join(NAMED_TRACES)})")
    try:
        return (kind if kind != "trace" else str(data["path"])), TraceSpec.model_validate(data)
    except ValidationError as exc:
        raise WorkloadError(f"workload {spec!r}: {format_validation_error(exc)}") from None


@functools.lru_cache(maxsize=4)
def _rows(path: str, mtime_ns: int) -> TraceRows:
    return read_trace(path)


def trace_rows(path: str) -> TraceRows:
    """The file's rows, read once per process while the file is unchanged (a sweep reads it at every point)."""
    try:
        mtime = Path(path).stat().st_mtime_ns
    except OSError as exc:
        raise WorkloadError(f"cannot read trace {path}: {exc.strerror}") from None
    return _rows(path, mtime)


def check_trace(spec: str) -> None:
    """Validate a trace spec and read its file (errors before a model loads); prompts are drawn later."""
    _, parsed = parse_trace_spec(spec)
    rows = trace_rows(parsed.path)
    _check_options(rows, parsed, spec)


@dataclass(frozen=True)
class Lengths:
    """What the length rule kept and how: per kept row its prompt and output length."""

    rows: np.ndarray  # indices into the window
    inputs: np.ndarray
    outputs: np.ndarray
    report: dict[str, Any]


def length_rule(inputs: np.ndarray, outputs: np.ndarray, spec: TraceSpec, context: int | None) -> Lengths:
    """Scale lengths, then drop or clip what is over the limits; every change counted (never silent)."""
    known = inputs >= 0  # cbcore text prompts: length unknown here (the engine checks them)
    n_in, n_out = inputs.copy(), outputs.copy()
    if spec.length_scale != 1:
        n_in = np.where(known, np.maximum(1, np.rint(n_in * spec.length_scale)), n_in).astype(np.int64)
        n_out = np.maximum(1, np.rint(n_out * spec.length_scale)).astype(np.int64)
    raised = int(((n_in == 0) & known).sum() + (n_out == 0).sum())
    n_in = np.where(known, np.maximum(n_in, 1), n_in)
    n_out = np.maximum(n_out, 1)
    big = np.iinfo(np.int64).max
    max_in = spec.max_input or big
    max_out = spec.max_output or big
    ctx = context or big
    over_in = known & (n_in > max_in)
    over_out = n_out > max_out
    over_ctx = known & (n_in + n_out > ctx)
    over = over_in | over_out | over_ctx
    report: dict[str, Any] = {
        "overlong": spec.overlong,
        "context": context,
        "max_input": spec.max_input,
        "max_output": spec.max_output,
        "requests": len(inputs),
        "over_limit": int(over.sum()),
        "prompt_over_max_input": int(over_in.sum()),
        "output_over_max_output": int(over_out.sum()),
        "over_context": int(over_ctx.sum()),
        "dropped": 0,
        "clipped": 0,
        "lengths_raised_to_1": raised,
    }
    if spec.overlong == "drop":
        keep = np.flatnonzero(~over)
        report["dropped"] = int(over.sum())
        return Lengths(keep, n_in[keep], n_out[keep], report)
    c_in = np.where(known, np.minimum(n_in, max_in), n_in)
    c_out = np.minimum(np.minimum(n_out, max_out), max(1, ctx - 1))
    excess = np.where(known, np.maximum(c_in + c_out - ctx, 0), 0)
    c_in = np.where(known, np.maximum(c_in - excess, 1), c_in)
    report["clipped"] = int(((c_in != n_in) | (c_out != n_out)).sum())
    report["prompts_clipped"] = int((c_in != n_in).sum())
    report["outputs_clipped"] = int((c_out != n_out).sum())
    return Lengths(np.arange(len(inputs)), c_in, c_out, report)


def load_trace(
    spec: str, vocab_size: int | None, special_ids: Seq[int] = (), context: int | None = None
) -> Workload:
    """The workload a trace spec describes; ``context`` is the model's (prompt + output) limit."""
    name, parsed = parse_trace_spec(spec)
    rows = trace_rows(parsed.path)
    _check_options(rows, parsed, spec)
    if rows.format != "cbcore" and vocab_size is None:
        raise WorkloadError(f"workload {spec!r}: drawing prompts needs the model's vocabulary size")
    window = _window(rows, parsed)
    if window.size == 0:
        raise WorkloadError(f"workload {spec!r}: no request of the trace falls in the window")
    lengths = length_rule(rows.inputs[window], rows.outputs[window], parsed, context)
    kept = window[lengths.rows]
    if kept.size == 0:
        raise WorkloadError(
            f"workload {spec!r}: every one of the window's {window.size} requests is over the length limits "
            f"({_limits(lengths.report)}); raise them, or use overlong=clip"
        )
    times, scale = _arrivals(rows, kept, parsed, spec)
    if rows.format == "cbcore":
        requests = _cbcore_requests(rows, kept, lengths, times)
    else:
        assert vocab_size is not None
        requests = _requests(rows, kept, lengths, times, parsed, vocab_size, tuple(sorted(set(special_ids))))
    info = {
        "source": name,
        "file": parsed.path,
        "format": rows.format,
        "rows": len(rows),
        "window": {"start_s": parsed.start_s, "duration_s": parsed.duration_s, "limit": parsed.limit,
                   "rows": int(window.size)},
        "time_scale": scale,
        "length_scale": parsed.length_scale,
        "length_rule": lengths.report,
        "seed": parsed.seed,
    }  # fmt: skip
    log.info("trace read", **{k: info[k] for k in ("source", "format", "rows")}, requests=len(requests),
             dropped=lengths.report["dropped"], clipped=lengths.report["clipped"])  # fmt: skip
    return Workload(spec.strip(), tuple(requests), trace=info)


def _check_options(rows: TraceRows, spec: TraceSpec, text: str) -> None:
    given = spec.model_fields_set
    if rows.times is None:
        timed = {"time_scale", "start_s", "duration_s"} & given
        if timed:
            raise WorkloadError(
                f"workload {text!r}: {sorted(timed)[0]}: {spec.path} holds no arrival times "
                f"(columns {', '.join(rows.columns)}); give rate=R to draw Poisson arrivals"
            )
        if spec.rate is None:
            raise WorkloadError(
                f"workload {text!r}: {spec.path} holds no arrival times (columns {', '.join(rows.columns)}); "
                "give rate=R to draw Poisson arrivals"
            )
    if rows.format == "cbcore":
        records = rows.records or []
        if any(r.follows is not None for r in records) and given - {"path"}:
            raise WorkloadError(
                f"workload {text!r}: {spec.path} is closed-loop (requests follow others' answers); "
                "it replays only as it is (no window, scaling or length rule)"
            )
        if spec.draws_classes:
            raise WorkloadError(f"workload {text!r}: a cbcore trace sets its own clients, priorities and deadlines")
        if spec.length_scale != 1 and any(r.synthetic_prompt is None for r in records):
            raise WorkloadError(f"workload {text!r}: length_scale needs synthetic prompts; this trace holds its prompts")


def _window(rows: TraceRows, spec: TraceSpec) -> np.ndarray:
    """Row indices in the window, in arrival order (file order among equal times)."""
    if rows.times is None:
        index = np.arange(len(rows))
    else:
        t = rows.times
        end = math.inf if spec.duration_s is None else spec.start_s + spec.duration_s
        index = np.flatnonzero((t >= spec.start_s) & (t < end))
        index = index[np.argsort(t[index], kind="stable")]
    return index if spec.limit is None else index[: spec.limit]


def _arrivals(rows: TraceRows, kept: np.ndarray, spec: TraceSpec, text: str) -> tuple[np.ndarray, float | None]:
    """Arrival offsets of the kept rows (from the window's start), and the time scale applied."""
    if rows.times is None:
        assert spec.rate is not None
        rng = random.Random(f"{spec.seed}-arrival")
        return np.array(arrival_times(len(kept), spec.rate, 1.0, rng)), None
    times = rows.times[kept] - spec.start_s
    scale = spec.time_scale or 1.0
    if spec.rate is not None:
        span = float(times.max() - times.min())
        if span <= 0:
            raise WorkloadError(f"workload {text!r}: rate= needs arrivals spread over time ({len(kept)} at one instant)")
        scale = len(kept) / (span * spec.rate)
    return times * scale, scale


def _requests(
    rows: TraceRows, kept: np.ndarray, lengths: Lengths, times: np.ndarray, spec: TraceSpec,
    vocab_size: int, special: tuple[int, ...],
) -> list[BenchRequest]:  # fmt: skip
    block = None if rows.block_tokens is None else rows.block_tokens * spec.length_scale
    if block is not None and block < 1:
        raise WorkloadError(f"length_scale={spec.length_scale:g} makes the {rows.block_tokens}-token blocks empty")
    who, due = random.Random(f"{spec.seed}-classes"), random.Random(f"{spec.seed}-deadlines")
    classes = [spec.draw_class(who, due) for _ in range(len(rows))] if spec.draws_classes else None
    out = []
    for row, t, n_in, n_out in zip(kept.tolist(), times.tolist(), lengths.inputs.tolist(),
                                   lengths.outputs.tolist(), strict=True):  # fmt: skip
        if block is None:
            source: dict[str, Any] = {"row": row}
        else:
            assert rows.hash_ids is not None
            hashes = rows.hash_ids[row]
            n_in = min(n_in, math.floor(len(hashes) * block))  # a scaled length may round past its last block
            source = {"hash_ids": hashes[: blocks_for(n_in, block)], "block_tokens": block}
        prompt = SyntheticPrompt(tokens=n_in, seed=spec.seed, vocab_size=vocab_size, special_ids=special, **source)
        client, priority, deadline = classes[row] if classes else ("default", 0, None)
        out.append(
            BenchRequest(
                request_id=f"r{row}", arrival_s=t, max_new_tokens=n_out, synthetic_prompt=prompt,
                ignore_eos=True, client_id=client, priority=priority, deadline_s=deadline,
            )
        )  # fmt: skip
    return out


def _cbcore_requests(rows: TraceRows, kept: np.ndarray, lengths: Lengths, times: np.ndarray) -> list[BenchRequest]:
    """cbcore's own records in the window, with their new arrival times and (clipped) lengths."""
    assert rows.records is not None
    out = []
    for row, t, n_in, n_out in zip(kept.tolist(), times.tolist(), lengths.inputs.tolist(),
                                   lengths.outputs.tolist(), strict=True):  # fmt: skip
        record = rows.records[row]
        update: dict[str, Any] = {"max_new_tokens": n_out}
        if record.follows is None:
            update["arrival_s"] = t
        if record.prompt_token_ids is not None and n_in != len(record.prompt_token_ids):
            update["prompt_token_ids"] = record.prompt_token_ids[:n_in]
        elif record.synthetic_prompt is not None and n_in != record.synthetic_prompt.tokens:
            update["synthetic_prompt"] = _resized(record.synthetic_prompt, n_in)
        out.append(record.model_copy(update=update))
    return out


def _resized(prompt: SyntheticPrompt, tokens: int) -> SyntheticPrompt:
    if prompt.hash_ids is None:
        return prompt.model_copy(update={"tokens": tokens})
    tokens = min(tokens, math.floor(len(prompt.hash_ids) * prompt.block_tokens))
    hashes = prompt.hash_ids[: blocks_for(tokens, prompt.block_tokens)]
    return prompt.model_copy(update={"tokens": tokens, "hash_ids": hashes})


def _limits(report: dict[str, Any]) -> str:
    parts = [f"{key} {report[key]}" for key in ("max_input", "max_output", "context") if report.get(key)]
    return ", ".join(parts) or "none"


def describe_rule(trace: dict[str, Any]) -> str:
    """One line for the report: the trace, its window and time scale, and what the length rule did."""
    rule = trace["length_rule"]
    win = trace["window"]
    parts = [f"trace {trace['source']} ({trace['format']}, {trace['rows']} rows)"]
    if win["rows"] != trace["rows"]:
        span = "" if win["duration_s"] is None else f" +{win['duration_s']:g} s"
        limit = "" if win["limit"] is None else f", first {win['limit']}"
        parts.append(f"window from {win['start_s']:g} s{span}{limit}: {win['rows']} rows")
    if trace.get("time_scale") not in (None, 1.0):
        parts.append(f"arrivals x{trace['time_scale']:.4g}")
    if trace.get("length_scale", 1.0) != 1.0:
        parts.append(f"lengths x{trace['length_scale']:g}")
    limits = _limits(rule)
    if rule["overlong"] == "drop":
        what = f"{rule['dropped']} of {rule['requests']} requests over the limits ({limits}) dropped"
    else:
        what = (
            f"{rule['clipped']} of {rule['requests']} requests clipped to the limits ({limits}): "
            f"{rule['prompts_clipped']} prompts, {rule['outputs_clipped']} outputs"
        )
    parts.append(what)
    if rule["lengths_raised_to_1"]:
        parts.append(f"{rule['lengths_raised_to_1']} zero lengths raised to 1")
    return "; ".join(parts)
