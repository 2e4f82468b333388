"""The static-batching baseline: a new wave starts only when the last one ended."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from cbcore.policy import BudgetPolicy, SchedulerState, SequenceView, StepLimits


class StaticParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_num_seqs: int = Field(8, ge=1, description="Wave size (slots).")
    max_num_batched_tokens: int = Field(8192, ge=1, description="Most tokens in one forward.")


class Static(BudgetPolicy):
    """Admit a wave of up to ``max_num_seqs`` requests, then nobody until all of it finished.

    The wave stays open while it is still filling (until a member has produced
    its first token or the wave is full), so a wave whose prompts do not all fit
    one step's token budget still forms as one wave. Members preempted by
    recompute are re-admitted: they belong to the current wave.
    """

    name = "static"
    Params = StaticParams

    def __init__(self, params: StaticParams | None = None) -> None:
        super().__init__(params)
        self.wave: set[str] = set()
        self.wave_open = True
        self.waves_started = 0

    def limits(self, state: SchedulerState) -> StepLimits:
        if not self.wave:  # the whole previous wave has finished
            self.wave_open = True
        return StepLimits(self.params.max_num_seqs, self.params.max_num_batched_tokens)

    def may_admit(self, seq: SequenceView, state: SchedulerState) -> bool:
        if seq.request_id in self.wave:
            return True
        if not self.wave_open or len(self.wave) >= self.params.max_num_seqs:
            return False
        if not self.wave:
            self.waves_started += 1
        self.wave.add(seq.request_id)
        return True

    def on_step_end(self, results, now: float) -> None:
        if any(r.new_token is not None for r in results if r.seq.request_id in self.wave):
            self.wave_open = False

    def on_finish(self, seq: SequenceView, now: float) -> None:
        self.wave.discard(seq.request_id)
