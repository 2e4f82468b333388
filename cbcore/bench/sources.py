"""Where a workload comes from: ``seed``, a trace (a file or a shipped one), or a generator spec.

Kept apart from :mod:`cbcore.bench.workload` (the data types) so that the
generator and the trace reader can build on those types without the modules
importing each other.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from pathlib import Path

from cbcore.bench.generator import GENERATORS, generate
from cbcore.bench.trace_formats import sniff_format
from cbcore.bench.traces import NAMED_TRACES, check_trace, is_trace, load_trace
from cbcore.bench.workload import BenchRequest, Workload, WorkloadError


def seed_workload() -> Workload:
    """The seeds' experiment (the requests ``cb demo`` runs), all arriving at t=0."""
    from cbcore.demo.run import DEMO_REQUESTS

    requests = tuple(
        BenchRequest(request_id=f"seed-{i}", arrival_s=0.0, max_new_tokens=cap, prompt=text)
        for i, (text, cap) in enumerate(DEMO_REQUESTS)
    )
    return Workload("seed", requests)


def load_workload(
    spec: str, vocab_size: int | None = None, special_ids: Seq[int] = (), context: int | None = None
) -> Workload:
    """``seed``, a trace, or a generator spec.

    Drawing prompts (a generator's, a trace's) needs the vocabulary;
    ``context`` (the model's prompt + output limit) is what a trace's length
    rule holds requests to by default.
    """
    spec = spec.strip()
    if spec == "seed":
        return seed_workload()
    kind = spec.split(":", 1)[0]
    if kind in GENERATORS:
        if vocab_size is None:
            raise WorkloadError(f"workload {spec!r}: drawing prompts needs the model's vocabulary size")
        return generate(spec, vocab_size, special_ids)
    if is_trace(spec):
        return load_trace(spec, vocab_size, special_ids, context)
    if Path(spec).exists() or spec.endswith(".jsonl"):
        if Path(spec).is_file() and sniff_format(spec) != "cbcore":
            return load_trace(f"trace:path={spec}", vocab_size, special_ids, context)
        return Workload.load(spec)
    raise WorkloadError(
        f"workload {spec!r}: expected 'seed', a .jsonl trace, or a generator "
        f"({', '.join(f'{g}:key=value,...' for g in GENERATORS)}); or a production trace "
        f"(trace:path=FILE,..., {', '.join(NAMED_TRACES)})"
    )


def needs_vocabulary(spec: str) -> bool:
    """The spec draws prompts (a generator or a trace other than cbcore's own): checked now, drawn later.

    Lets a command refuse a bad spec or an unreadable trace before it loads a model.
    """
    from cbcore.bench.generator import is_generator

    spec = spec.strip()
    if is_generator(spec):
        return True
    if is_trace(spec):
        check_trace(spec)
        return True
    if Path(spec).is_file() and sniff_format(spec) != "cbcore":
        check_trace(f"trace:path={spec}")
        return True
    return False
