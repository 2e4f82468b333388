"""Priority order with optional aging."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from cbcore.scheduling.policy import QueuePolicy, SequenceView


class PriorityParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    aging_s: float | None = Field(
        None,
        gt=0,
        description="Every aging_s seconds since arrival lower the effective priority value by 1 "
        "(so long waits eventually win); None disables aging.",
    )
    preempt_running: bool = Field(
        True,
        description="A waiting request that finds no free slot or KV blocks may evict running "
        "requests of strictly lower effective priority.",
    )


class Priority(QueuePolicy):
    """Lower ``priority`` value first; ties by arrival time.

    Without aging a steady stream of urgent requests can starve a low-priority
    one forever; with ``aging_s`` its effective value falls by one for every
    ``aging_s`` seconds it has existed, so it is eventually served.
    """

    name = "priority"
    Params = PriorityParams

    def __init__(self, params: PriorityParams | None = None) -> None:
        super().__init__(params)
        self._fixed_keys = self.params.aging_s is None  # without aging a key never changes after arrival

    def effective_priority(self, seq: SequenceView, now: float) -> float:
        if self.params.aging_s is None:
            return float(seq.priority)
        return seq.priority - (now - seq.arrival_time) / self.params.aging_s

    def key(self, seq: SequenceView, now: float) -> tuple[float, float, str]:
        return (self.effective_priority(seq, now), seq.arrival_time, seq.request_id)

    def outranks(self, a: SequenceView, b: SequenceView, now: float) -> bool:
        # Only a strictly better priority may evict: equal priorities never
        # preempt each other (that would just thrash on arrival order).
        return self.params.preempt_running and self.effective_priority(a, now) < self.effective_priority(b, now)
