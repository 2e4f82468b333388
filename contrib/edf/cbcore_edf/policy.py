"""Earliest deadline first, with a fallback class and optional demotion of requests that cannot make it.

EDF serves the request whose deadline (arrival + ``deadline_s``) comes first.
Below capacity that meets every deadline any order could meet. Past capacity
it collapses: the queue grows, every request's deadline is near or gone, and
EDF spends the machine on the requests that are already late, or will be by
the time they finish (they have the earliest deadlines), so nearly all of them
miss. Demotion repairs that: a request that can no longer make its deadline
(now + its remaining tokens x the time a token takes passes the deadline)
moves to the fallback class, behind every request that still can, and the
machine goes to those. The time a token takes is measured from the engine's
own steps unless ``demote_tpot_s`` sets it; ``max_new_tokens`` bounds the
remaining tokens, so a request that stops early at EOS may be demoted early.

Requests without a deadline form the fallback class, served after every
request with a deadline, in arrival order; or, with ``fallback_deadline_s``,
they compete as if their deadline were that many seconds after arrival.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence as Seq

from pydantic import BaseModel, ConfigDict, Field

from cbcore import QueuePolicy, SequenceView, StepResult

STEPS_MEASURED = 32

# Class 0 is served first: requests whose deadline may still be met; class 1 is the fallback.
ON_TIME, FALLBACK = 0, 1


class EDFParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    fallback_deadline_s: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="Requests without a deadline compete as if it were this many seconds after arrival; "
        "None: they are served after every request with a deadline, in arrival order.",
    )
    demote: bool = Field(
        False,
        description="Move a request that can no longer make its deadline to the fallback class, "
        "behind every request that still can (once demoted, it stays demoted).",
    )
    demote_tpot_s: float | None = Field(
        None,
        ge=0,
        allow_inf_nan=False,
        description="With demote: the time each remaining output token takes (max_new_tokens minus those "
        "generated); a request is demoted once now plus that time passes its deadline. None: the median "
        "interval between the engine's last steps, measured as it runs; 0: only once the deadline has passed.",
    )
    preempt_running: bool = Field(
        False,
        description="A waiting request that finds no free slot or KV blocks may evict running requests "
        "it strictly outranks (a later deadline, or the fallback class).",
    )


class EarliestDeadlineFirst(QueuePolicy):
    """Earliest deadline first; ties by arrival time."""

    name = "edf"
    Params = EDFParams

    def __init__(self, params: EDFParams | None = None) -> None:
        super().__init__(params)
        self.demoted: set[str] = set()
        self.live: dict[str, SequenceView] = {}  # requests with a deadline, for demotion at each step's end
        # Intervals between the last steps: a running request gains one token per step, so their
        # median is the time a remaining token takes (the median ignores the gap after an idle spell).
        self.step_intervals: deque[float] = deque(maxlen=STEPS_MEASURED)
        self._last_step: float | None = None

    def on_arrival(self, seq: SequenceView, now: float) -> None:
        if self.params.demote and seq.deadline is not None:
            self.live[seq.request_id] = seq

    def on_step_end(self, results: Seq[StepResult], now: float) -> None:
        if self._last_step is not None and now > self._last_step:
            self.step_intervals.append(now - self._last_step)
        self._last_step = now
        for rid, seq in self.live.items():  # once it cannot make its deadline, it stays demoted
            if rid not in self.demoted and self.hopeless(seq, now):
                self.demoted.add(rid)

    def on_finish(self, seq: SequenceView, now: float) -> None:
        self.demoted.discard(seq.request_id)
        self.live.pop(seq.request_id, None)

    def token_time(self) -> float:
        """Seconds a remaining output token is expected to take: the parameter, or the measured steps."""
        if self.params.demote_tpot_s is not None:
            return self.params.demote_tpot_s
        return statistics.median(self.step_intervals) if self.step_intervals else 0.0

    def hopeless(self, seq: SequenceView, now: float) -> bool:
        """Whether ``seq`` can no longer finish by its deadline (checked only with ``demote``)."""
        if seq.request_id in self.demoted:
            return True
        deadline = seq.deadline
        if deadline is None:
            return False
        remaining = max(seq.params.max_new_tokens - seq.num_output_tokens, 0)
        return now + self.token_time() * remaining > deadline

    def rank(self, seq: SequenceView, now: float) -> tuple[int, float]:
        """(class, time by which it should be done): the first part of the sort key."""
        deadline = seq.deadline
        if deadline is None and self.params.fallback_deadline_s is not None:
            deadline = seq.arrival_time + self.params.fallback_deadline_s
        if deadline is None or (self.params.demote and self.hopeless(seq, now)):
            return (FALLBACK, seq.arrival_time)
        return (ON_TIME, deadline)

    def key(self, seq: SequenceView, now: float) -> tuple[int, float, float, str]:
        return (*self.rank(seq, now), seq.arrival_time, seq.request_id)

    def outranks(self, a: SequenceView, b: SequenceView, now: float) -> bool:
        """On-time requests outrank the fallback class, and each other by deadline.

        Within the fallback class nobody outranks anybody: evicting by arrival order would only thrash.
        """
        if not self.params.preempt_running:
            return False
        (class_a, due_a), (class_b, due_b) = self.rank(a, now), self.rank(b, now)
        if class_a != class_b:
            return class_a < class_b
        return class_a == ON_TIME and due_a < due_b


class EDFDemoteParams(EDFParams):
    demote: bool = Field(True, description=EDFParams.model_fields["demote"].description)


class EDFDemote(EarliestDeadlineFirst):
    """``edf`` with ``demote: true`` by default, so that a ``--policy`` mix can name it."""

    name = "edf-demote"
    Params = EDFDemoteParams
