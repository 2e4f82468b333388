"""Assembling one step's plan: what is scheduled so far and how much budget is left.

The phases of :class:`~cbcore.scheduling.policy_scheduler.PolicyScheduler` add
to a :class:`PlanBuilder` and, when they evict, take back from it; the waiting
queue is only put in order if a phase reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

from cbcore.scheduling.scheduler import ScheduledSeq, SchedulerOutput
from cbcore.scheduling.sequence import Sequence


@dataclass
class PlanBuilder:
    out: SchedulerOutput
    tokens_left: int
    seqs_left: int
    tokens: dict[Sequence, int] = field(default_factory=dict)
    partials: set[Sequence] = field(default_factory=set)  # chunks shorter than what was pending

    @property
    def empty(self) -> bool:
        return not self.tokens

    def add(self, seq: Sequence, n: int) -> None:
        if n < seq.num_pending_tokens:
            self.partials.add(seq)
        self.out.scheduled.append(ScheduledSeq(seq, n))
        self.tokens[seq] = n
        self.tokens_left -= n
        self.seqs_left -= 1

    def add_decodes(self, seqs: list[Sequence]) -> None:
        self.out.scheduled.extend([ScheduledSeq(seq, 1) for seq in seqs])
        self.tokens.update(dict.fromkeys(seqs, 1))
        self.tokens_left -= len(seqs)
        self.seqs_left -= len(seqs)

    def unschedule(self, seq: Sequence) -> None:
        n = self.tokens.pop(seq)
        self.partials.discard(seq)
        self.out.scheduled = [s for s in self.out.scheduled if s.seq is not seq]
        self.tokens_left += n
        self.seqs_left += 1


class OrderedOnDemand(Seq[Sequence]):
    """The waiting queue in queue order, sorted on first use.

    Most steps with every slot taken never look at the waiting queue, and
    sorting a long one with a time-dependent key (aging) would cost more than
    the rest of the step.
    """

    def __init__(self, order: Callable[[], list[Sequence]]) -> None:
        self._order = order
        self._items: list[Sequence] | None = None

    @property
    def items(self) -> list[Sequence]:
        if self._items is None:
            self._items = self._order()
        return self._items

    def __getitem__(self, index: Any) -> Any:
        return self.items[index]

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self.items)


def check_swap_order(out: SchedulerOutput) -> None:
    """Fail loudly if a plan would overwrite a host block before it is read back."""
    if out.swap_in and out.swap_out:
        reused = {h for h, _ in out.swap_in} & {h for _, h in out.swap_out}
        if reused:
            raise RuntimeError(f"scheduler bug: host blocks {sorted(reused)} swapped out and in in one step")
