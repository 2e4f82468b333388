"""Skip-join multi-level feedback queue, after FastServe (Wu et al., 2023).

Output lengths are unknown, so instead of predicting them MLFQ learns them:
every request starts high and sinks one level each time it has generated its
level's quantum of tokens, so short requests finish in the top levels while
long ones drift down and stop delaying them. Quanta grow geometrically
(``base_quantum * quantum_growth ** level``) so a long job is not demoted at
every step.

Skip-join: a long prompt would spend its whole top-level quantum on the
prefill alone, so a request joins the highest level whose quantum covers its
prompt's cost (``num_prompt_tokens * prompt_token_cost`` generated-token
equivalents) instead of always the top one. Optionally a request that has
waited ``promote_after_s`` seconds without producing a token goes back to the
top level, so the lowest level cannot starve (checked as each step ends:
levels change only in events, so ordering never changes what it orders by).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from pydantic import BaseModel, ConfigDict, Field

from cbcore import QueuePolicy, SequenceView, StepResult


class MLFQParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_levels: int = Field(4, ge=1, description="Number of priority levels (0 is served first).")
    base_quantum: int = Field(8, ge=1, description="Generated tokens a request may spend at level 0.")
    quantum_growth: float = Field(2.0, ge=1, description="Each level's quantum is this times the previous.")
    prompt_token_cost: float = Field(
        1 / 16,
        ge=0,
        description="Cost of one prompt token in generated-token units, for the skip-join entry level "
        "(prefill is batched, so a prompt token is cheaper than a decode step).",
    )
    promote_after_s: float | None = Field(
        None, gt=0, description="Back to level 0 after waiting this long for a token; None: never."
    )
    preempt_running: bool = Field(
        True,
        description="A waiting request that finds no free slot or KV blocks may evict running requests "
        "on a strictly lower level (FastServe is preemptive).",
    )


class SkipJoinMLFQ(QueuePolicy):
    """Serve the highest non-empty level first; arrival order within a level."""

    name = "mlfq"
    Params = MLFQParams

    def __init__(self, params: MLFQParams | None = None) -> None:
        super().__init__(params)
        self.levels: dict[str, int] = {}  # request -> current level
        self._used: dict[str, int] = {}  # request -> tokens generated at its current level
        self._last_served: dict[str, float] = {}
        self.num_demotions = 0
        self.num_promotions = 0

    def quantum(self, level: int) -> int:
        return max(1, round(self.params.base_quantum * self.params.quantum_growth**level))

    def entry_level(self, seq: SequenceView) -> int:
        cost = seq.num_prompt_tokens * self.params.prompt_token_cost
        for level in range(self.params.num_levels):
            if cost <= self.quantum(level):
                return level
        return self.params.num_levels - 1

    def level(self, seq: SequenceView, now: float) -> int:
        """Its current level (one not seen arriving is placed as if it just did)."""
        level = self.levels.get(seq.request_id)
        return self.entry_level(seq) if level is None else level

    # -- events --------------------------------------------------------------

    def on_arrival(self, seq: SequenceView, now: float) -> None:
        self.levels[seq.request_id] = self.entry_level(seq)
        self._used[seq.request_id] = 0
        self._last_served[seq.request_id] = now

    def on_step_end(self, results: Seq[StepResult], now: float) -> None:
        last = self.params.num_levels - 1
        limit = self.params.promote_after_s
        if limit is not None:  # back to the top after waiting too long for a token
            for rid, level in self.levels.items():
                if level > 0 and now - self._last_served[rid] > limit:
                    self.levels[rid], self._used[rid], self._last_served[rid] = 0, 0, now
                    self.num_promotions += 1
        for r in results:
            rid = r.seq.request_id
            if r.new_token is None or rid not in self.levels:
                continue
            self._last_served[rid] = now
            self._used[rid] += 1
            level = self.levels[rid]
            if level < last and self._used[rid] >= self.quantum(level):
                self.levels[rid] = level + 1
                self._used[rid] = 0
                self.num_demotions += 1

    def on_finish(self, seq: SequenceView, now: float) -> None:
        for state in (self.levels, self._used, self._last_served):
            state.pop(seq.request_id, None)

    # -- ordering ------------------------------------------------------------

    def key(self, seq: SequenceView, now: float) -> tuple[int, float, str]:
        return (self.level(seq, now), seq.arrival_time, seq.request_id)

    def outranks(self, a: SequenceView, b: SequenceView, now: float) -> bool:
        return self.params.preempt_running and self.level(a, now) < self.level(b, now)
