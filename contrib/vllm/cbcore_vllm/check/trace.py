"""What one engine decided, step by step: the record both sides of the decision check fill.

A step is one ``schedule()`` with requests to serve (an engine idle between
arrivals plans nothing, and the step clock does not advance). The vLLM side
is filled by a :class:`Tracer` that ``cbcore_vllm.Scheduler`` calls when one
is set (``scheduler.tracer``); besides what was scheduled and preempted it
keeps what the documented differences are recognised by: who asked for the
room a victim freed, how many requests were eligible, admissions the KV cache
refused though a first chunk would have fitted, clamped limits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class StepTrace:
    k: int  # the driver's iteration (requests with arrive == k are added before it)
    scheduled: dict[str, int] = field(default_factory=dict)  # tokens per request, in the engine's order
    preempted: list[str] = field(default_factory=list)
    askers: list[str] = field(default_factory=list)  # vLLM: the request whose room each victim freed
    waiting_behind: list[int] = field(default_factory=list)  # vLLM: running requests after the asker, per victim
    eligible: int | None = None  # vLLM: requests running or waiting when the step was planned
    running: int | None = None  # vLLM: requests running when the step was planned
    max_num_seqs: int | None = None  # vLLM: the budget's max_num_seqs for the step
    clamped: bool = False  # vLLM: the budget's limits exceeded vLLM's flags
    kv_refused: list[dict[str, Any]] = field(default_factory=list)  # vLLM: whole-prompt admissions refused


@dataclass
class Trace:
    engine: str
    steps: list[StepTrace] = field(default_factory=list)
    output_lengths: dict[str, int] = field(default_factory=dict)
    finish: dict[str, str | None] = field(default_factory=dict)
    error: str | None = None
    chunk_threshold: int = 0  # vLLM: long_prefill_token_threshold (0: none)

    def first_scheduled(self) -> list[tuple[int, str]]:
        """(step's k, request id) in the order requests were first scheduled."""
        seen: set[str] = set()
        out = []
        for step in self.steps:
            for rid in step.scheduled:
                if rid not in seen:
                    seen.add(rid)
                    out.append((step.k, rid))
        return out

    def victims(self) -> list[tuple[int, str]]:
        return [(step.k, rid) for step in self.steps for rid in step.preempted]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Trace:
        return cls(**{**data, "steps": [StepTrace(**s) for s in data["steps"]]})


class Tracer:
    """Filled by ``cbcore_vllm.Scheduler`` (``scheduler.tracer = Tracer(...)``) as it decides."""

    def __init__(self, external: Callable[[str], str] = str) -> None:
        self.external = external  # vLLM's id -> the caller's (its engine appends a suffix)
        self.steps: list[StepTrace] = []
        self.k = 0  # set by the driver before each engine step

    def planning(self, scheduler: Any, step: int, limits: Any, clamped: bool) -> None:
        num_running, num_waiting = scheduler.get_request_counts()
        self.steps.append(
            StepTrace(
                k=self.k,
                eligible=num_running + num_waiting,
                running=num_running,
                max_num_seqs=limits.max_num_seqs,
                clamped=clamped,
            )
        )

    def victim(self, step: int, victim: str, asker: str, behind: int) -> None:
        """``behind``: running requests after the asker in vLLM's order (not yet scheduled this step)."""
        self.steps[-1].preempted.append(self.external(victim))
        self.steps[-1].askers.append(self.external(asker))
        self.steps[-1].waiting_behind.append(behind)

    def admission_refused(self, scheduler: Any, request: Any, num_new_tokens: int, kwargs: dict[str, Any]) -> None:
        """The KV cache refused a waiting request; note it if only the whole-prompt reservation did."""
        if not kwargs.get("full_sequence_must_fit"):
            return
        size = scheduler.block_size
        have = -(-(request.num_computed_tokens + kwargs.get("num_new_computed_tokens", 0)) // size)
        chunk = -(-(request.num_computed_tokens + kwargs.get("num_new_computed_tokens", 0) + num_new_tokens) // size)
        whole = -(-request.num_tokens // size)
        free = scheduler._kv_view.num_free_blocks
        if chunk - have <= free < whole - have:
            refused = {"id": self.external(request.request_id), "whole_blocks": whole - have}
            self.steps[-1].kv_refused.append(refused | {"chunk_blocks": chunk - have, "free_blocks": free})

    def scheduled(self, step: int, out: Any) -> None:
        last = self.steps[-1]
        if not (out.num_scheduled_tokens or last.preempted or last.kv_refused):
            self.steps.pop()  # nothing decided (vLLM flushing finished ids, or all waiting): not recorded
            return
        self.steps[-1].scheduled = {self.external(rid): n for rid, n in out.num_scheduled_tokens.items()}
