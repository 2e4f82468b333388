"""The seeds' experiment: six requests on three slots, static waves vs continuous batching.

Both runs use the same engine and differ only in the budget policy: ``static``
admits a new wave only when the whole previous one has finished (the baseline
of the seeds), ``token-budget`` admits a request as soon as a slot is free.
Prompts are prefilled whole in both, as in the seeds. A step listener gives
every running sequence a stable slot number, so the admissions can be shown
as they happen and the slot timeline drawn afterwards.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from cbcore.config import EngineConfig
from cbcore.engine import Engine, StepRecord
from cbcore.outputs import RequestOutput
from cbcore.scheduling.sampling_params import SamplingParams

# (prompt, max new tokens), in arrival order, as in the seeds.
DEMO_REQUESTS: list[tuple[str, int]] = [
    ("The capital of France is", 6),
    ("Today's weather is so", 50),
    ("In machine learning, a transformer is", 300),
    ("Once upon a time in a land far away,", 30),
    ("Quantum computing differs from classical computing because", 180),
    ("The history of the Roman Empire began", 45),
]
SLOTS = 3
LABELS = [chr(ord("A") + i) for i in range(len(DEMO_REQUESTS))]

RunKind = Literal["static", "continuous"]


def demo_scheduler(kind: RunKind, slots: int = SLOTS) -> dict[str, Any]:
    """The ``scheduler`` config section of each run."""
    budget = "static" if kind == "static" else "token-budget"
    return {
        "queue": {"name": "fcfs"},
        "budget": {"name": budget, "max_num_seqs": slots},
        "prefill": {"name": "whole-prompt"},
        "preemption": {"name": "recompute"},
    }


@dataclass(frozen=True)
class SlotEvent:
    step: int
    kind: Literal["admit", "done", "preempt", "idle"]
    slot: int
    label: str
    output: RequestOutput | None = None  # for "done"
    waiting: tuple[str, ...] = ()  # for "idle": who is still queued


class SlotTracker:
    """Step listener: maps running sequences to slots 0..n-1 and records who held which slot when.

    A sequence keeps its slot from its first scheduled step until it finishes
    (or is preempted); the lowest free slot is taken, as in the seeds.
    """

    def __init__(
        self, labels: dict[str, str], num_slots: int, on_event: Callable[[SlotEvent], None] | None = None
    ) -> None:
        self.labels = labels  # request id -> display label
        self.slots: list[str | None] = [None] * num_slots
        self.on_event = on_event
        self.timeline: list[list[str | None]] = []  # per step: label per slot
        self.admitted: set[str] = set()
        self.idle_while_waiting = 0  # slot-steps left empty although a request was queued
        self.step_seconds: dict[int, list[float]] = {}  # sequences in the step -> step times
        self._freed: list[int] = []

    def _emit(self, event: SlotEvent) -> None:
        if self.on_event is not None:
            self.on_event(event)

    def _free(self, request_id: str) -> int | None:
        label = self.labels.get(request_id)
        if label not in self.slots:
            return None
        slot = self.slots.index(label)
        self.slots[slot] = None
        return slot

    def __call__(self, record: StepRecord) -> None:
        step = record.stats.step
        for seq in record.output.preempted:
            slot = self._free(seq.request_id)
            if slot is not None:
                self._emit(SlotEvent(step, "preempt", slot, self.labels[seq.request_id]))
        for item in record.output.scheduled:
            label = self.labels[item.seq.request_id]
            if label in self.slots:
                continue
            if None not in self.slots:  # more running sequences than slots were configured
                self.slots.append(None)
            slot = self.slots.index(None)
            self.slots[slot] = label
            self.admitted.add(label)
            self._emit(SlotEvent(step, "admit", slot, label))
        waiting = tuple(sorted(set(self.labels.values()) - self.admitted))
        if waiting:
            self.idle_while_waiting += self.slots.count(None)
            for slot in self._freed:
                if self.slots[slot] is None:
                    self._emit(SlotEvent(step, "idle", slot, "", waiting=waiting))
        self.timeline.append(list(self.slots))
        self.step_seconds.setdefault(record.stats.num_seqs, []).append(record.stats.total_s)
        self._freed = []
        for out in record.outputs:
            if out.finished:
                slot = self._free(out.request_id)
                if slot is not None:
                    self._freed.append(slot)
                    self._emit(SlotEvent(step, "done", slot, self.labels[out.request_id], out))

    @property
    def used_slot_steps(self) -> int:
        return sum(len(row) - row.count(None) for row in self.timeline)


@dataclass
class DemoRun:
    kind: RunKind
    wall_s: float
    outputs: dict[str, RequestOutput]  # by label
    tracker: SlotTracker
    steps: int = field(init=False)

    def __post_init__(self) -> None:
        self.steps = len(self.tracker.timeline)

    def tokens(self) -> dict[str, list[int]]:
        return {label: out.output_token_ids for label, out in self.outputs.items()}


def run_once(
    kind: RunKind,
    model: Any,
    tokenizer: Any,
    config: EngineConfig,
    on_event: Callable[[SlotEvent], None] | None = None,
    on_step: Callable[[StepRecord, SlotTracker], None] | None = None,
    requests: list[tuple[str, int]] | None = None,
) -> DemoRun:
    """Run ``requests`` (default: the demo's) to completion under ``config``; only the step loop is timed."""
    requests = DEMO_REQUESTS if requests is None else requests
    engine = Engine(model, tokenizer, config)
    labels = {LABELS[i]: LABELS[i] for i in range(len(requests))}
    tracker = SlotTracker(labels, SLOTS, on_event)
    engine.step_listeners.append(tracker)
    if on_step is not None:
        engine.step_listeners.append(lambda record: on_step(record, tracker))
    for label, (prompt, cap) in zip(LABELS, requests, strict=False):
        engine.add_request(prompt, SamplingParams(max_new_tokens=cap), request_id=label)
    outputs: dict[str, RequestOutput] = {}
    start = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
    wall = time.perf_counter() - start
    return DemoRun(kind, wall, dict(sorted(outputs.items())), tracker)


def warm_up(model: Any, tokenizer: Any, config: EngineConfig) -> None:
    """One short request first, so that neither timed run pays for first-call setup."""
    engine = Engine(model, tokenizer, config)
    engine.generate([DEMO_REQUESTS[0][0]], SamplingParams(max_new_tokens=2))
