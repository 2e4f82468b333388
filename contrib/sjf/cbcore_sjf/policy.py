"""Shortest predicted job first, with aging so that long jobs are not starved.

Serving the request with the fewest predicted remaining tokens first minimises
mean latency when predictions are good (SRPT). Pure SJF starves long jobs
under a steady stream of short ones; here a request's predicted size shrinks
as it waits: ``remaining / (1 + waited / aging_s)``. After waiting ``aging_s``
seconds a job competes as if it were half its size, so every job is
eventually served ahead of any newcomer.

``noise_sigma`` multiplies each prediction by a lognormal(0, sigma) factor
drawn per request (seeded by ``noise_seed`` and the request id), so a study
can ask how good a length predictor must be before SJF stops paying.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from pydantic import BaseModel, ConfigDict, Field, field_validator

from cbcore import QueuePolicy, SequenceView
from cbcore_sjf.predictors import resolve_predictor


class SJFParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    predictor: str = Field(
        "prompt-length",
        description="Output-length predictor: prompt-length, max-new-tokens, or module:function.",
    )
    aging_s: float | None = Field(
        10.0, gt=0, description="Waiting this long halves a job's predicted size; None: no aging."
    )
    noise_sigma: float = Field(
        0.0,
        ge=0,
        le=5,
        description="Multiply each prediction by lognormal(0, sigma) noise, to study a predictor's error; "
        "0: as predicted.",
    )
    noise_seed: int = Field(0, ge=0, description="Seed of the noise: a request's factor depends on it and its id only.")
    preempt_running: bool = Field(
        False,
        description="A waiting request that finds no free slot or KV blocks may evict running requests "
        "with a strictly larger aged size.",
    )

    @field_validator("predictor")
    @classmethod
    def _resolvable(cls, ref: str) -> str:
        resolve_predictor(ref)  # raises with the known names
        return ref


def noise_factor(seed: int, request_id: str, sigma: float) -> float:
    """A request's lognormal(0, sigma) error factor: the same in every run, whatever else arrives."""
    return random.Random(f"{seed}:{request_id}").lognormvariate(0.0, sigma)


class ShortestPredictedJobFirst(QueuePolicy):
    """Fewest predicted remaining output tokens first, aged by waiting time."""

    name = "sjf"
    Params = SJFParams

    def __init__(self, params: SJFParams | None = None) -> None:
        super().__init__(params)
        self.predict: Callable[[SequenceView], float] = resolve_predictor(self.params.predictor)
        self.predicted: dict[str, float] = {}  # request -> predicted output tokens, fixed at arrival

    def on_arrival(self, seq: SequenceView, now: float) -> None:
        predicted = float(self.predict(seq))
        if self.params.noise_sigma > 0:
            predicted *= noise_factor(self.params.noise_seed, seq.request_id, self.params.noise_sigma)
        self.predicted[seq.request_id] = predicted

    def on_finish(self, seq: SequenceView, now: float) -> None:
        self.predicted.pop(seq.request_id, None)

    def size(self, seq: SequenceView, now: float) -> float:
        """Predicted remaining output tokens, shrunk by the time waited since arrival."""
        predicted = self.predicted.get(seq.request_id)
        if predicted is None:  # arrived before this policy existed (not through the scheduler)
            predicted = float(self.predict(seq))
        remaining = max(predicted - seq.num_output_tokens, 0.0)
        if self.params.aging_s is None:
            return remaining
        return remaining / (1.0 + max(now - seq.arrival_time, 0.0) / self.params.aging_s)

    def key(self, seq: SequenceView, now: float) -> tuple[float, float, str]:
        return (self.size(seq, now), seq.arrival_time, seq.request_id)

    def outranks(self, a: SequenceView, b: SequenceView, now: float) -> bool:
        return self.params.preempt_running and self.size(a, now) < self.size(b, now)
