"""Request files for `cb generate` and `cb check`: one JSON object per line.

Each line is validated on its own, before the model is loaded, so a typo is
reported with its line number within a second and the good lines still run::

    {"prompt": "The capital of France is", "max_new_tokens": 8}
    {"messages": [{"role": "user", "content": "Hi!"}], "temperature": 0.7, "seed": 1,
     "priority": 1, "client_id": "alice", "deadline_s": 2.5, "attrs": {"tier": "gold"}, "id": "greeting"}
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from cbcore.cli.main import CLIError
from cbcore.plugins import validation_problems
from cbcore.scheduling.request import RequestFields
from cbcore.scheduling.sampling_params import SamplingParams

SAMPLING_FIELDS = ("max_new_tokens", "temperature", "top_k", "top_p", "seed")


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")  # chat templates may read more keys (name, tool calls)

    role: str
    content: str


class RequestRecord(RequestFields):
    """A request file's line: the prompt, sampling fields, and the shared scheduling fields."""

    model_config = ConfigDict(extra="forbid", strict=True)

    id: str | None = Field(None, min_length=1)
    prompt: str | None = None
    messages: list[Message] | None = Field(None, min_length=1)
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> RequestRecord:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        return self


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
        chosen = {k: getattr(record, k) for k in SAMPLING_FIELDS if getattr(record, k) is not None}
        params = SamplingParams(**{**defaults, **chosen})
    except ValidationError as exc:
        return BadInput(where, describe(exc))
    return Job(where, record.id or default_id, record, params)


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
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            data = json.loads(line)
        except json.JSONDecodeError as exc:
            bad.append(BadInput(where, f"not valid JSON: {exc.msg} (column {exc.colno})"))
            continue
        result = make_job(where, f"line-{number}", data, defaults)
        (bad if isinstance(result, BadInput) else jobs).append(result)
    if not jobs and not bad:
        raise CLIError(f"{path} holds no requests")
    seen: dict[str, str] = {}
    unique = []
    for job in jobs:
        if job.request_id in seen:
            bad.append(BadInput(job.where, f"id {job.request_id!r} already used at {seen[job.request_id]}"))
            continue
        seen[job.request_id] = job.where
        unique.append(job)
    return unique, bad


def encode(job: Job, tokenizer: Any) -> list[int]:
    """Token ids of the job's prompt; ``messages`` go through the tokenizer's chat template."""
    record = job.record
    if record.messages is None:
        return list(tokenizer.encode(record.prompt))
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; give 'prompt' instead of 'messages'")
    messages = [m.model_dump() for m in record.messages]
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return list(ids)
