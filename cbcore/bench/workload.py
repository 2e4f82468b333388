"""Requests and workloads: one record for request files, traces and benchmark workloads.

A :class:`RequestRecord` is one request as a JSON object: its prompt (text,
chat messages or token ids), how it decodes, and the scheduling fields
policies read. ``cb generate`` and ``cb check`` read files of them; a
:class:`BenchRequest` is the same record as one request of a workload, where
``request_id``, ``arrival_s`` and ``max_new_tokens`` are required. A workload
is a list of them with arrival offsets (seconds from the start of a run), from:

* ``seed`` — the six requests of the seeds' experiment, all at t=0;
* a JSONL trace, one record per line (what :meth:`Workload.save` writes), so
  that a run can be replayed exactly;
* a production trace read by :mod:`cbcore.bench.traces` (Azure, Mooncake, ...);
* a generator spec such as ``poisson:n=64,rate=2,lengths=sharegpt,seed=0``
  (:mod:`cbcore.bench.generator`).

A request may instead *follow* an earlier one (the next turn of a
conversation): it is sent ``arrival_s`` seconds after the request it follows
has finished, and its prompt is that request's prompt, its output, and then
its own prompt tokens. Such a workload is closed-loop: when a turn arrives
depends on how fast the previous one was served.

Every reader of a prompt goes through :meth:`RequestRecord.token_ids`, so a
record may hold its prompt in another form and produce the ids only when a
run needs them: ``synthetic_prompt`` is a trace's length, seed and shared
blocks (:class:`cbcore.bench.synthetic.SyntheticPrompt`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, model_validator

from cbcore.bench.synthetic import PromptIds, SyntheticPrompt
from cbcore.cli.config_files import format_validation_error
from cbcore.scheduling.request import RequestFields
from cbcore.scheduling.sampling_params import SamplingParams

#: The record fields that say how a request decodes (:meth:`RequestRecord.sampling_params`).
SAMPLING_FIELDS = ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "ignore_eos")
#: The order of a record's fields in JSON (a trace reads best with the id and arrival first).
JSON_ORDER = (
    "request_id", "arrival_s", "prompt", "messages", "prompt_token_ids", "synthetic_prompt", "max_new_tokens",
    "temperature",
    "top_k", "top_p", "seed", "priority", "client_id", "ignore_eos", "deadline_s", "follows",
)  # fmt: skip
#: The ways a record gives its prompt (exactly one per record).
PROMPT_FIELDS = ("prompt", "messages", "prompt_token_ids", "synthetic_prompt")
#: Names earlier versions used for a field: read as the field, with a note.
OLD_SPELLINGS = {"id": "request_id"}


def thaw(value: Any) -> Any:
    """Plain JSON (dicts and lists) from a frozen attribute value."""
    if isinstance(value, Mapping):
        return {key: thaw(item) for key, item in value.items()}
    if isinstance(value, tuple | list):
        return [thaw(item) for item in value]
    return value


class WorkloadError(ValueError):
    """A workload spec or trace is malformed; the message names the key or line."""


class Message(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)  # chat templates may read more keys (name, tool calls)

    role: str
    content: str


class RequestRecord(RequestFields):
    """One request: a line of a request file or of a trace; a workload's requests are :class:`BenchRequest`."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    request_id: str | None = Field(None, min_length=1)
    prompt: str | None = None
    messages: tuple[Message, ...] | None = Field(None, min_length=1, strict=False)
    prompt_token_ids: tuple[StrictInt, ...] | None = Field(None, strict=False)
    synthetic_prompt: SyntheticPrompt | None = Field(
        None, strict=False, description="Token ids drawn when needed, from a length, a seed and shared blocks."
    )
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    ignore_eos: bool = False
    arrival_s: float | None = Field(None, ge=0, allow_inf_nan=False, description="Seconds after the run starts.")
    follows: str | None = Field(None, min_length=1, description="Request whose answer this one continues.")

    @model_validator(mode="before")
    @classmethod
    def _old_spellings(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(old in data for old in OLD_SPELLINGS):
            for old, new in OLD_SPELLINGS.items():
                if old in data and new in data:
                    raise ValueError(f"give {new!r} only ({old!r} is its old spelling)")
            data = {OLD_SPELLINGS.get(key, key): value for key, value in data.items()}
        return data

    @model_validator(mode="after")
    def _one_prompt(self) -> RequestRecord:
        given = [f for f in PROMPT_FIELDS if getattr(self, f) is not None]
        if len(given) != 1:
            raise ValueError(
                "give exactly one of 'prompt' or 'messages' (text) or 'prompt_token_ids' or 'synthetic_prompt'"
            )
        if self.prompt is not None and not self.prompt:
            raise ValueError("prompt is empty")
        if self.prompt_token_ids is not None:
            if not self.prompt_token_ids:
                raise ValueError("prompt_token_ids is empty")
            if min(self.prompt_token_ids) < 0:
                raise ValueError("prompt_token_ids holds a negative id")
        return self

    @property
    def is_text(self) -> bool:
        """The prompt is text (or chat messages): its token ids need the model's tokenizer."""
        return self.prompt is not None or self.messages is not None

    @property
    def num_prompt_tokens(self) -> int | None:
        """The prompt's length when known without a tokenizer (token ids or a synthetic prompt)."""
        if self.prompt_token_ids is not None:
            return len(self.prompt_token_ids)
        if self.synthetic_prompt is not None:
            return self.synthetic_prompt.tokens
        return None

    def lazy_token_ids(self, tokenizer: Any | None) -> Seq[int]:
        """:meth:`token_ids`, except that a synthetic prompt stays a recipe (:class:`PromptIds`) until read."""
        if self.synthetic_prompt is not None:
            return PromptIds(self.synthetic_prompt)
        return self.token_ids(tokenizer)

    def sampling_params(self, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """How this request decodes: its own sampling fields, ``defaults`` for those it leaves out."""
        chosen = {key: value for key in SAMPLING_FIELDS if (value := getattr(self, key)) is not None}
        return SamplingParams(**{**(defaults or {}), **chosen})

    def token_ids(self, tokenizer: Any | None) -> list[int]:
        """The prompt as token ids: text is encoded as the engine encodes it, messages by the chat template."""
        if self.prompt_token_ids is not None:
            return list(self.prompt_token_ids)
        if self.synthetic_prompt is not None:
            return self.synthetic_prompt.ids()
        if tokenizer is None:
            raise WorkloadError(f"request {self.request_id}: a text prompt needs a tokenizer")
        if self.prompt is not None:
            return list(tokenizer.encode(self.prompt))
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; give 'prompt' instead of 'messages'")
        messages = [m.model_dump() for m in self.messages or ()]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        return list(ids)

    def to_json(self) -> dict[str, Any]:
        """The record as a JSON object: the fields it sets (and the scheduling fields), as a trace line reads."""
        fields = self.model_dump(mode="json", exclude_none=True, exclude={"attrs"})
        data = {key: fields[key] for key in JSON_ORDER if key in fields}
        if self.attrs:
            data["attrs"] = thaw(self.attrs)
        return data


class BenchRequest(RequestRecord):
    """One request of a workload: sent ``arrival_s`` after the run starts, greedy, up to ``max_new_tokens``.

    Greedy because every row of a benchmark is checked against the per-prompt
    greedy reference and the outside baselines decode greedily; the sampling
    fields are for request files.
    """

    request_id: str = Field(min_length=1)
    arrival_s: float = Field(ge=0, allow_inf_nan=False, description="Seconds after the run starts.")
    max_new_tokens: int = Field(ge=1)

    @model_validator(mode="after")
    def _greedy(self) -> BenchRequest:
        sampled = [f for f in ("temperature", "top_k", "top_p", "seed") if getattr(self, f) is not None]
        if sampled:
            raise ValueError(f"{sampled[0]}: a workload decodes greedily (sampling fields are for request files)")
        return self


@dataclass(frozen=True)
class Workload:
    name: str
    requests: tuple[BenchRequest, ...]
    # Where a trace's requests came from and what was done to them (window, scaling, the length
    # rule's counts: :func:`cbcore.bench.traces.load_trace`); None for other workloads.
    trace: dict[str, Any] | None = None

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
            **({"trace": self.trace} if self.trace is not None else {}),
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


def json_objects(lines: Iterable[str], source: str) -> Iterator[tuple[int, dict]]:
    """(line number, object) of each non-blank line; the first that is not a JSON object is reported by line."""
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError as exc:
            raise WorkloadError(f"{source}:{number}: not valid JSON ({exc.msg})") from None
        if not isinstance(data, dict):
            raise WorkloadError(f"{source}:{number}: expected a JSON object, got {type(data).__name__}")
        yield number, data


def parse_trace(lines: Seq[str], source: str = "trace") -> list[BenchRequest]:
    """Validate every line; the first bad one is reported as ``source:LINE: problem``.

    A line without ``request_id`` is named ``line-N``.
    """
    requests = []
    for number, data in json_objects(lines, source):
        if not any(key in data for key in ("request_id", *OLD_SPELLINGS)):
            data["request_id"] = f"line-{number}"
        try:
            requests.append(BenchRequest.model_validate(data))
        except ValidationError as exc:
            raise WorkloadError(f"{source}:{number}: {format_validation_error(exc)}") from None
    if not requests:
        raise WorkloadError(f"{source}: the trace holds no requests")
    return requests
