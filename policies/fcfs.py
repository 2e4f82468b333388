"""First come, first served."""

from __future__ import annotations

from cbcore.scheduling.policy import QueuePolicy, SequenceView


class FCFS(QueuePolicy):
    """Serve in arrival order; the newest arrival is evicted first.

    A sequence preempted by recompute keeps its arrival time, so it goes back
    to the front of the queue rather than behind later arrivals.
    """

    name = "fcfs"
    _fixed_keys = True  # a key never changes after arrival: the scheduler stores it then

    def key(self, seq: SequenceView, now: float) -> tuple[float, str]:
        return (seq.arrival_time, seq.request_id)
