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

    A wave is the first ``max_num_seqs`` waiting requests in queue order when
    the previous wave has ended, topped up while none of its members has
    produced a token (the prompts of a wave may take several steps to prefill
    under the token budget; they are still one batch). Then it is closed:
    nobody else is admitted until every member has finished. Members
    preempted by recompute are re-admitted: they belong to the current wave.
    """

    name = "static"
    Params = StaticParams

    def __init__(self, params: StaticParams | None = None) -> None:
        super().__init__(params)
        self.members: set[str] = set()  # the current wave's requests that have run
        self.closed = False  # a member has produced a token: the wave takes nobody new
        self.frozen: set[str] = set()  # when closed, the members-to-be that were waiting then
        self.waves_started = 0
        self._wave: tuple[SchedulerState | None, frozenset[str]] = (None, frozenset())

    def limits(self, state: SchedulerState) -> StepLimits:
        return StepLimits(self.params.max_num_seqs, self.params.max_num_batched_tokens)

    def may_admit(self, seq: SequenceView, state: SchedulerState) -> bool:
        rid = seq.request_id
        return rid in self.members or rid in (self.frozen if self.closed else self.joining(state))

    def joining(self, state: SchedulerState) -> frozenset[str]:
        """While the wave is open: the waiting requests it takes, the first in queue order, up to its size."""
        if self._wave[0] is not state:  # remembered per step: may_admit asks once per waiting request
            # Running requests count even before their first event (under vLLM's async scheduling a step is
            # planned before the previous one's results are told).
            taken = self.members.union(v.request_id for v in state.running)
            room = self.params.max_num_seqs - len(taken)
            first = [w.request_id for w in state.waiting if w.request_id not in taken][: max(room, 0)]
            self._wave = (state, frozenset(first))
        return self._wave[1]

    @property
    def wave(self) -> set[str]:
        """Every request of the current wave: those that ran and those it still waits for (when closed)."""
        return self.members | self.frozen

    def on_step_end(self, results: Seq[StepResult], now: float) -> None:
        ran = [r.seq.request_id for r in results if not r.preempted]
        if ran and not self.members:
            self.waves_started += 1
        self.members.update(ran)
        if not self.closed and any(r.new_token is not None for r in results):
            self.closed, self.frozen = True, set(self._wave[1])  # as planned in the step that closed it
        self.frozen -= self.members

    def on_finish(self, seq: SequenceView, now: float) -> None:
        self.members.discard(seq.request_id)
        self.frozen.discard(seq.request_id)
        if not self.members and not self.frozen:
            self.closed = False
