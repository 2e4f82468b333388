"""Request files for `cb generate` and `cb check`: one JSON object per line.

Each line is validated on its own, before the model is loaded, so a typo is
reported with its line number within a second and the good lines still run::

    {"prompt": "The capital of France is", "max_new_tokens": 8}
    {"messages": [{"role": "user", "content": "Hi!"}], "temperature": 0.7, "seed": 1,
     "priority": 1, "client_id": "alice", "deadline_s": 2.5, "attrs": {"tier": "gold"}, "request_id": "greeting"}
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from cbcore.bench.workload import OLD_SPELLINGS, RequestRecord
from cbcore.cli.main import CLIError
from cbcore.plugins import validation_problems
from cbcore.scheduling.sampling_params import SamplingParams

#: Record fields that place a request in a workload's time line, which a request file does not have.
WORKLOAD_FIELDS = ("arrival_s", "follows")


@dataclass
class Job:
    """One validated request and where it came from (for error messages)."""

    where: str  # "prompts.jsonl:3" or "argument 2"
    request_id: str
    record: RequestRecord
    params: SamplingParams


@dataclass(frozen=True)
class BadInput:
    where: str
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


def make_job(where: str, default_id: str, data: Any, defaults: dict[str, Any]) -> Job | BadInput:
    """Validate one record; ``defaults`` fill the sampling fields the record leaves out."""
    if not isinstance(data, dict):
        return BadInput(where, f"expected a JSON object, got {type(data).__name__}")
    try:
        record = RequestRecord.model_validate(data)
        params = record.sampling_params(defaults)
    except ValidationError as exc:
        return BadInput(where, describe(exc))
    if timed := [f for f in WORKLOAD_FIELDS if getattr(record, f) is not None]:
        return BadInput(where, f"{timed[0]}: every request of a request file starts at once (arrival times "
                        "and follow-ups are for cb bench and cb simulate workloads)")  # fmt: skip
    return Job(where, record.request_id or default_id, record, params)


def describe(exc: ValidationError) -> str:
    """``field: message`` per problem, on one line (an unknown field gets the closest known one)."""
    model = RequestRecord if exc.title == "RequestRecord" else SamplingParams
    return "; ".join(validation_problems(exc, model))


def read_jobs(path: str, defaults: dict[str, Any]) -> tuple[list[Job], list[BadInput]]:
    """All good lines of ``path`` as jobs, and one :class:`BadInput` per bad line."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise CLIError(f"cannot read {path}: {reason}") from None
    jobs: list[Job] = []
    bad: list[BadInput] = []
    noted = False  # one note per file for an old field name
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            data = json.loads(line)
        except json.JSONDecodeError as exc:
            bad.append(BadInput(where, f"not valid JSON: {exc.msg} (column {exc.colno})"))
            continue
        if isinstance(data, dict) and (old := [k for k in OLD_SPELLINGS if k in data]) and not noted:
            noted = True
            print(f"cb: note: {where}: {old[0]!r} is read as {OLD_SPELLINGS[old[0]]!r}, its new name", file=sys.stderr)
        result = make_job(where, f"line-{number}", data, defaults)
        (bad if isinstance(result, BadInput) else jobs).append(result)
    if not jobs and not bad:
        raise CLIError(f"{path} holds no requests")
    seen: dict[str, str] = {}
    unique = []
    for job in jobs:
        if job.request_id in seen:
            bad.append(BadInput(job.where, f"request_id {job.request_id!r} already used at {seen[job.request_id]}"))
            continue
        seen[job.request_id] = job.where
        unique.append(job)
    return unique, bad
