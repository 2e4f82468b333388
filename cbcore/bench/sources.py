"""Where a workload comes from: ``seed``, a JSONL trace, or a generator spec.

Kept apart from :mod:`cbcore.bench.workload` (the data types) so that the
generator can build on those types without the two importing each other.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from pathlib import Path

from cbcore.bench.generator import GENERATORS, generate
from cbcore.bench.workload import BenchRequest, Workload, WorkloadError


def seed_workload() -> Workload:
    """The seeds' experiment (the requests ``cb demo`` runs), all arriving at t=0."""
    from cbcore.demo.run import DEMO_REQUESTS

    requests = tuple(
        BenchRequest(request_id=f"seed-{i}", arrival_s=0.0, max_new_tokens=cap, prompt=text)
        for i, (text, cap) in enumerate(DEMO_REQUESTS)
    )
    return Workload("seed", requests)


def load_workload(spec: str, vocab_size: int | None = None, special_ids: Seq[int] = ()) -> Workload:
    """``seed``, a trace path, or a generator spec (which needs the vocabulary to draw prompts from)."""
    spec = spec.strip()
    if spec == "seed":
        return seed_workload()
    kind = spec.split(":", 1)[0]
    if kind in GENERATORS:
        if vocab_size is None:
            raise WorkloadError(f"workload {spec!r}: drawing prompts needs the model's vocabulary size")
        return generate(spec, vocab_size, special_ids)
    if Path(spec).exists() or spec.endswith(".jsonl"):
        return Workload.load(spec)
    raise WorkloadError(
        f"workload {spec!r}: expected 'seed', a .jsonl trace, or a generator "
        f"({', '.join(f'{g}:key=value,...' for g in GENERATORS)})"
    )
