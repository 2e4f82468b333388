"""The progress guarantee: a scheduler that stops making progress is stopped with an error.

Two ways to spin forever, whatever the scheduler:

* a step that computes nothing while work waits. If nothing changed either
  (no preemption, swap or failure) the next step would be the same, so it
  raises at once; steps that only move work around are allowed a few in a row;
* preemptions that undo all progress (a ranking that lets two requests evict
  each other forever, each losing its prompt chunks before it samples). Every
  computed token that has not led to a sampled one sits in the KV cache,
  unless a preemption threw it away; so a scheduler that computes more than
  a few times the cache's capacity without a single token being sampled is
  only churning. Legitimate recompute preemption under memory pressure stays
  far below that bound.
"""

from __future__ import annotations

from collections.abc import Callable

from cbcore.scheduling.scheduler import SchedulerOutput, SchedulerStall

MAX_IDLE_STEPS = 8
WINDOW_CAPACITIES = 4


class ProgressGuard:
    def __init__(self, capacity_tokens: int) -> None:
        self.window = WINDOW_CAPACITIES * capacity_tokens
        self.spent = 0  # tokens computed since a token was last sampled
        self.idle = 0  # steps in a row that computed nothing

    def observe(
        self, out: SchedulerOutput, computed: int, sampled: int, has_work: Callable[[], bool], culprit: str
    ) -> None:
        """Account for one checked plan; raises :class:`SchedulerStall` naming ``culprit``."""
        if computed == 0 and not out.failed:
            if not has_work():
                return
            self.idle += 1
            moved = out.preempted or out.swap_out or out.swap_in
            if not moved or self.idle > MAX_IDLE_STEPS:
                what = "changed nothing" if not moved else f"computed nothing for {self.idle} steps"
                raise SchedulerStall(
                    f"{culprit} planned no tokens while work waits and {what}: it would spin forever",
                    plugin=culprit,
                    rule="a step computes tokens while work waits",
                )
            return
        self.idle = 0
        if sampled:
            self.spent = 0
            return
        self.spent += computed
        if self.spent > self.window:
            raise SchedulerStall(
                f"{culprit} computed {self.spent} tokens without sampling one (more than {WINDOW_CAPACITIES}x "
                "the KV cache's capacity): preemptions keep throwing work away, a livelock",
                plugin=culprit,
                rule="preemptions do not undo all progress",
            )
