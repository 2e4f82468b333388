"""Benchmark workloads: what is asked, and when.

A workload is a list of requests with arrival offsets (seconds from the start
of a run). It comes from one of three places:

* ``seed`` — the six requests of the seeds' experiment, all at t=0;
* a JSONL trace, one request per line (what :meth:`Workload.save` writes), so
  that a run can be replayed exactly;
* a generator spec such as ``poisson:n=64,rate=2,lengths=sharegpt,seed=0``
  (:mod:`cbcore.bench.generator`).

A request may instead *follow* an earlier one (the next turn of a
conversation): it is sent ``arrival_s`` seconds after the request it follows
has finished, and its prompt is that request's prompt, its output, and then
its own prompt tokens. Such a workload is closed-loop: when a turn arrives
depends on how fast the previous one was served.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ConfigDict, Field, ValidationError, model_validator

from cbcore.config import format_validation_error
from cbcore.scheduling.request import EMPTY_ATTRS, RequestFields, freeze_attrs


def thaw(value: Any) -> Any:
    """Plain JSON (dicts and lists) from a frozen attribute value."""
    if isinstance(value, Mapping):
        return {key: thaw(item) for key, item in value.items()}
    if isinstance(value, tuple | list):
        return [thaw(item) for item in value]
    return value


class WorkloadError(ValueError):
    """A workload spec or trace is malformed; the message names the key or line."""


class TraceRecord(RequestFields):
    """One line of a JSONL trace: the prompt, its arrival, and the shared scheduling fields."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    request_id: str | None = Field(None, min_length=1)
    arrival_s: float = Field(ge=0, allow_inf_nan=False, description="Seconds after the run starts.")
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    max_new_tokens: int = Field(ge=1)
    ignore_eos: bool = False
    follows: str | None = Field(None, min_length=1, description="Request whose answer this one continues.")

    @model_validator(mode="after")
    def _one_prompt(self) -> TraceRecord:
        if (self.prompt is None) == (self.prompt_token_ids is None):
            raise ValueError("give exactly one of prompt (text) or prompt_token_ids")
        if self.prompt is not None and not self.prompt:
            raise ValueError("prompt is empty")
        if self.prompt_token_ids is not None:
            if not self.prompt_token_ids:
                raise ValueError("prompt_token_ids is empty")
            if min(self.prompt_token_ids) < 0:
                raise ValueError("prompt_token_ids holds a negative id")
        return self


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload; greedy decoding, up to ``max_new_tokens``."""

    request_id: str
    arrival_s: float
    max_new_tokens: int
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    priority: int = 0
    client_id: str = "default"
    ignore_eos: bool = False
    deadline_s: float | None = None  # seconds after arrival
    attrs: Mapping[str, Any] = field(default_factory=lambda: EMPTY_ATTRS)  # JSON attributes, read-only
    # The request this one continues: sent arrival_s after it finished, its prompt and output before ours.
    follows: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "attrs", freeze_attrs(self.attrs))

    def token_ids(self, tokenizer: Any | None) -> list[int]:
        """The prompt as token ids (text is encoded the way the engine encodes it)."""
        if self.prompt_token_ids is not None:
            return list(self.prompt_token_ids)
        if tokenizer is None:
            raise WorkloadError(f"request {self.request_id}: a text prompt needs a tokenizer")
        return list(tokenizer.encode(self.prompt))

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"request_id": self.request_id, "arrival_s": self.arrival_s}
        if self.prompt_token_ids is not None:
            data["prompt_token_ids"] = list(self.prompt_token_ids)
        else:
            data["prompt"] = self.prompt
        data.update(
            max_new_tokens=self.max_new_tokens,
            priority=self.priority,
            client_id=self.client_id,
            ignore_eos=self.ignore_eos,
        )
        if self.deadline_s is not None:
            data["deadline_s"] = self.deadline_s
        if self.follows is not None:
            data["follows"] = self.follows
        if self.attrs:
            data["attrs"] = thaw(self.attrs)
        return data


@dataclass(frozen=True)
class Workload:
    name: str
    requests: tuple[BenchRequest, ...]

    def __post_init__(self) -> None:
        if not self.requests:
            raise WorkloadError(f"workload {self.name!r} has no requests")
        ids = [r.request_id for r in self.requests]
        if len(set(ids)) != len(ids):
            dup = next(i for i in ids if ids.count(i) > 1)
            raise WorkloadError(f"workload {self.name!r}: request id {dup!r} appears twice")
        seen: set[str] = set()
        for r in self.requests:
            if r.follows is not None and r.follows not in seen:
                raise WorkloadError(
                    f"workload {self.name!r}: request {r.request_id!r} follows {r.follows!r}, "
                    "which is not an earlier request of the workload"
                )
            seen.add(r.request_id)

    @property
    def is_closed_loop(self) -> bool:
        """Some request is sent only after another one finished."""
        return any(r.follows is not None for r in self.requests)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def clients(self) -> list[str]:
        return sorted({r.client_id for r in self.requests})

    @property
    def span_s(self) -> float:
        """Time between the first and the last arrival (of requests that follow none)."""
        times = [r.arrival_s for r in self.requests if r.follows is None]
        return max(times) - min(times)

    def describe(self) -> dict[str, Any]:
        """A summary for reports (the full trace is what :meth:`save` writes)."""
        return {
            "name": self.name,
            "num_requests": len(self.requests),
            "arrival_span_s": self.span_s,
            "max_new_tokens_total": sum(r.max_new_tokens for r in self.requests),
            "clients": self.clients,
            "follow_ups": sum(r.follows is not None for r in self.requests),
        }

    def save(self, path: str | Path) -> None:
        lines = [json.dumps(r.to_json()) for r in self.requests]
        Path(path).write_text("\n".join(lines) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Workload:
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as exc:
            raise WorkloadError(f"cannot read trace {path}: {exc.strerror}") from None
        return cls(str(path), tuple(parse_trace(text.splitlines(), str(path))))


def parse_trace(lines: Seq[str], source: str = "trace") -> list[BenchRequest]:
    """Validate every line; the first bad one is reported as ``source:LINE: problem``."""
    requests = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError as exc:
            raise WorkloadError(f"{source}:{number}: not valid JSON ({exc.msg})") from None
        if not isinstance(data, dict):
            raise WorkloadError(f"{source}:{number}: expected a JSON object, got {type(data).__name__}")
        try:
            rec = TraceRecord.model_validate(data)
        except ValidationError as exc:
            raise WorkloadError(f"{source}:{number}: {format_validation_error(exc)}") from None
        requests.append(
            BenchRequest(
                request_id=rec.request_id if rec.request_id is not None else f"line-{number}",
                arrival_s=rec.arrival_s,
                max_new_tokens=rec.max_new_tokens,
                prompt=rec.prompt,
                prompt_token_ids=tuple(rec.prompt_token_ids) if rec.prompt_token_ids is not None else None,
                priority=rec.priority,
                client_id=rec.client_id,
                ignore_eos=rec.ignore_eos,
                deadline_s=rec.deadline_s,
                attrs=rec.attrs,
                follows=rec.follows,
            )
        )
    if not requests:
        raise WorkloadError(f"{source}: the trace holds no requests")
    return requests
