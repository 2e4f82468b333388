"""What stands between the engine and its scheduler: no plugin can make it lie, hang or lose work.

The engine runs outside code every step (four policies, or a whole-scheduler
plugin). :class:`StepGuard` gives it three guarantees whatever that code does:

* **checked plans** -- every plan is checked before the runner sees it
  (:mod:`cbcore.scheduling.plan_check`); a broken rule is a
  :class:`SchedulerError` naming the plugin, its origin and the rule;
* **progress** -- a scheduler that plans nothing, or whose preemptions undo all
  progress, raises :class:`SchedulerStall` (:mod:`cbcore.scheduling.progress`);
* **undo** -- state is captured before each step, and any failure in it (a
  plugin method raising, a refused plan, a failed forward) puts it back, so
  the engine is as it was before the step. The error names plugin, method and
  request (:mod:`cbcore.scheduling.blame`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from cbcore.config import EngineConfig
from cbcore.scheduling.blame import blame, describe
from cbcore.scheduling.plan import StepPlan
from cbcore.scheduling.plan_check import checked_plan
from cbcore.scheduling.policy_scheduler import PolicyScheduler
from cbcore.scheduling.progress import ProgressGuard
from cbcore.scheduling.rollback import SeqUndo
from cbcore.scheduling.scheduler import Scheduler, SchedulerError, SchedulerOutput
from cbcore.scheduling.sequence import Sequence


class StepGuard:
    def __init__(self, scheduler: Scheduler, config: EngineConfig, clock: Callable[[], float]) -> None:
        self.scheduler = scheduler
        self.names = plugin_names(scheduler, config)
        self.clock = clock
        blocks = scheduler.blocks
        self.block_size = blocks.block_size
        self.num_blocks = blocks.num_blocks
        self.num_host_blocks = blocks.num_host_blocks
        policies = getattr(scheduler, "policies", None)
        if id(scheduler) in self.names:
            self.culprit = self.names[id(scheduler)]
        elif policies is not None:
            self.culprit = "scheduler of " + ", ".join(self.names.get(id(p), repr(p)) for p in policies)
        else:
            self.culprit = f"scheduler {type(scheduler).__name__}"
        self.progress = ProgressGuard(blocks.capacity_tokens)

    def snapshot(self, live: Mapping[str, Sequence]) -> Callable[[], None]:
        """Capture what the coming step may change; the result puts it back.

        A scheduler with its own ``snapshot()`` (the composed one) restores its
        queues too; for any other the engine restores the sequences and the
        block manager, and the plugin's private state is its own.
        """
        own = getattr(self.scheduler, "snapshot", None)
        if own is not None:
            return self.call(own)
        blocks = self.scheduler.blocks
        undo = SeqUndo(list(live.values()), (), blocks, self.clock())
        return lambda: undo.restore(blocks)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``; an exception out of plugin code becomes a :class:`SchedulerError` naming it."""
        try:
            return fn(*args)
        except SchedulerError:
            raise
        except Exception as exc:
            raise self.named(exc) from exc

    def named(self, exc: BaseException) -> BaseException:
        """``exc`` as a :class:`SchedulerError` naming the plugin frame it came from (else unchanged)."""
        if isinstance(exc, SchedulerError):
            return exc
        found = blame(exc, self.names)
        if found is None:
            return exc
        plugin, method, request_id = found
        about = f" for request {request_id!r}" if request_id else ""
        err = SchedulerError(
            f"{plugin} raised in {method}(){about}: {type(exc).__name__}: {exc}; the engine is as before the step",
            plugin=plugin,
            rule=f"{method}() raised",
            request_id=request_id,
        )
        err.__cause__ = exc
        return err

    def check(self, out: SchedulerOutput) -> StepPlan:
        """The checked plan; raises if the plan or the progress is wrong."""
        plan, computed, sampled = checked_plan(
            out, self.block_size, self.num_blocks, self.num_host_blocks, self.culprit
        )
        has_work = lambda: self.call(self.scheduler.has_unfinished)  # noqa: E731
        self.progress.observe(out, computed, sampled, has_work, self.culprit)
        return plan


def plugin_names(scheduler: Scheduler, config: EngineConfig) -> dict[int, str]:
    """``id(plugin)`` -> ``kind 'name' (origin)`` for the scheduler plugin or the four policies.

    The composed scheduler learns them too, so that the errors it raises
    itself say where a policy came from.
    """
    from cbcore.plugins import get_registry

    registry = get_registry(tuple(config.plugins))
    sched = config.scheduler
    if isinstance(scheduler, PolicyScheduler):
        slots = ("queue", "budget", "prefill", "preemption")
        found = {slot: (getattr(scheduler, slot), getattr(sched, slot).name) for slot in slots}
    else:
        found = {"scheduler": (scheduler, sched.name)}
    names = {}
    for kind, (plugin, name) in found.items():
        try:
            origin = registry.get(kind, name).origin if name is not None else None
        except Exception:  # a scheduler built outside the config: no origin to tell
            origin = None
        names[id(plugin)] = describe(plugin, origin)
    if isinstance(scheduler, PolicyScheduler):
        scheduler.names.update(names)
    return names
