"""The Scheduler protocol, what one ``schedule()`` call decides, and the errors a scheduler can cause.

The composed scheduler (:mod:`cbcore.scheduling.policy_scheduler`) implements
this protocol; so does a whole-scheduler plugin (``scheduler: {name: ...}``),
which subclasses :class:`SchedulerPlugin`.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import ClassVar, Protocol, runtime_checkable

from cbcore.plugins import NoParams
from cbcore.scheduling.block_manager import BlockManager
from cbcore.scheduling.policy import StepLimits, StepResult
from cbcore.scheduling.sequence import Sequence


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # pending tokens of this sequence that run this step


@dataclass
class SchedulerOutput:
    """One step's decision: who runs with how many tokens, and the KV moves it needs first."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    failed: list[Sequence] = field(default_factory=list)  # finished with an error by the scheduler
    limits: StepLimits | None = None  # the step's budget, checked by the engine when set


@runtime_checkable
class Scheduler(Protocol):
    """Decides, every step, which sequences run and with how many tokens.

    The scheduler owns the waiting/running/swapped sets and the KV block
    bookkeeping; the engine owns the model and the tokens. ``snapshot()`` is
    taken before every step and returns what puts the scheduler's *own* state
    (its queues, counters) back if the step fails; the engine restores the
    sequences and the block manager itself (:mod:`cbcore.scheduling.step`).
    ``on_step_end`` is told what the committed step did; ``end`` removes a
    request the engine ends outside a plan (an abort, a failed policy call).
    """

    blocks: BlockManager

    def add(self, seq: Sequence) -> None: ...
    def schedule(self) -> SchedulerOutput: ...
    def on_step_end(self, output: SchedulerOutput, results: Seq[StepResult]) -> None: ...
    def abort(self, request_id: str) -> Sequence | None: ...
    def snapshot(self) -> Callable[[], None]: ...


class SchedulerPlugin:
    """Base for a registered whole-scheduler replacement (``scheduler: {name: ...}``).

    Subclasses implement the :class:`Scheduler` protocol; they are built with
    their validated ``Params`` and the engine's :class:`BlockManager`.
    """

    name: ClassVar[str]
    kind: ClassVar[str] = "scheduler"
    Params: ClassVar[type] = NoParams

    def __init__(self, params: object, blocks: BlockManager) -> None:
        self.params, self.blocks = params, blocks

    def snapshot(self) -> Callable[[], None]:
        """Override to restore private queues after a failed step (sequences and blocks are the engine's)."""
        return lambda: None


class SchedulerError(RuntimeError):
    """A scheduler (or one of its policies) broke the engine's rules; nothing of the step was applied.

    ``plugin`` names the culprit as ``kind name (origin)``, ``rule`` the rule
    it broke (or the method that raised), ``request_id`` the request involved
    when there is one.
    """

    def __init__(self, message: str, *, plugin: str = "", rule: str = "", request_id: str | None = None) -> None:
        super().__init__(message)
        self.plugin, self.rule, self.request_id = plugin, rule, request_id


class SchedulerStall(SchedulerError):
    """The scheduler has work but makes no progress: nothing planned, or preemptions undo all of it."""
