"""The static-batching baseline: a new wave starts only when the last one ended."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from pydantic import BaseModel, ConfigDict, Field

from cbcore.scheduling.policy import BudgetPolicy, SchedulerState, SequenceView, StepLimits, StepResult


class StaticParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_num_seqs: int = Field(8, ge=1, description="Wave size (slots).")
    max_num_batched_tokens: int = Field(8192, ge=1, description="Most tokens in one forward.")


class Static(BudgetPolicy):
    """Run a wave of up to ``max_num_seqs`` requests; the next wave starts when all of it finished.

    A wave is picked, in queue order, from the requests waiting when the
    previous wave has ended, and topped up with new arrivals only while none
    of its members has produced a token (the prompts of a wave may take several
    steps to prefill under the token budget; they are still one batch). Then it
    is closed: nobody else is admitted until every member has finished. Members
    preempted by recompute are re-admitted: they belong to the current wave.
    """

    name = "static"
    Params = StaticParams

    def __init__(self, params: StaticParams | None = None) -> None:
        super().__init__(params)
        self.wave: set[str] = set()
        self.closed = False
        self.waves_started = 0

    def limits(self, state: SchedulerState) -> StepLimits:
        if not self.wave:  # the whole previous wave has finished
            self.closed = False
        if not self.closed:
            if not self.wave and state.waiting:
                self.waves_started += 1
            for seq in state.waiting:
                if len(self.wave) >= self.params.max_num_seqs:
                    break
                self.wave.add(seq.request_id)
        return StepLimits(self.params.max_num_seqs, self.params.max_num_batched_tokens)

    def may_admit(self, seq: SequenceView, state: SchedulerState) -> bool:
        return seq.request_id in self.wave

    def on_step_end(self, results: Seq[StepResult], now: float) -> None:
        if any(r.new_token is not None and r.seq.request_id in self.wave for r in results):
            self.closed = True

    def on_finish(self, seq: SequenceView, now: float) -> None:
        self.wave.discard(seq.request_id)
