"""Plugins that misbehave on cue, for the adversarial property test (loaded by file path).

Each reads ``self.faults`` (a :class:`Faults`, set by the test after the
engine is built) and misbehaves once, at the step and in the way it says:
an answer against a rule, an exception of any kind (``RAISED``), writes to
everything it was handed (``write``: each is tried, the ones that got
through are kept in ``Faults.leaks``, then the first refusal is raised), or
a sleep (``sleep``: ``Faults.sleep_s``).
"""

from __future__ import annotations

import time
from collections import deque

from cbcore.policies import FCFS, ChunkedPrefill, Recompute, Swap, TokenBudget
from cbcore.policies.preemption import SwapParams
from cbcore.scheduling.scheduler import ScheduledSeq, SchedulerOutput, SchedulerPlugin
from cbcore.scheduling.sequence import SequenceStatus
from cbcore.testing.writes import try_writes

RAISED = {
    "raise": RuntimeError,
    "exit": SystemExit,
    "interrupt": KeyboardInterrupt,
    "generator_exit": GeneratorExit,
    "memory": MemoryError,
}


class Faults:
    """At most one fault: (target, step, kind); ``fire`` answers once, at that step."""

    def __init__(self, target: str, step: int, kind: str) -> None:
        self.target, self.at, self.kind = target, step, kind
        self.step = 0
        self.fired = False
        self.enabled = True
        self.leaks: list[str] = []  # writes that got through (kind "write")
        self.sleep_s = 0.0

    def fire(self, target: str) -> str | None:
        if self.enabled and not self.fired and target == self.target and self.step >= self.at:
            self.fired = True
            return self.kind
        return None


def _fire(policy, target, *handed):
    """The fault due now at ``target`` (None: none); raising, writing to ``handed`` and sleeping are done here."""
    plan = getattr(policy, "faults", None)
    kind = plan.fire(target) if plan is not None else None
    if kind in RAISED:
        raise RAISED[kind](f"{target} failed")
    if kind == "write":
        attempts = [a for i, obj in enumerate(handed) for a in try_writes(obj, f"{target}:{i}", depth=4)]
        plan.leaks += [what for what, refused in attempts if refused is None]
        raise next(refused for _, refused in attempts if refused is not None)
    if kind == "sleep":
        time.sleep(plan.sleep_s)
    return kind


class FaultyQueue(FCFS):
    name = "faulty-queue"
    _fixed_keys = False  # order() is asked every step

    def outranks(self, a, b, now):  # preemptive admission by arrival
        return self.key(a, now) < self.key(b, now)

    def order(self, seqs, now):
        ordered = super().order(seqs, now)
        kind = _fire(self, "order", *seqs)
        if kind == "duplicate" and ordered:
            return ordered + ordered[:1]
        if kind == "drop" and ordered:
            return ordered[1:]
        if kind == "wrong_type":
            return "not a list"
        return ordered

    def on_arrival(self, seq, now):
        _fire(self, "on_arrival", seq)

    def on_step_end(self, results, now):
        _fire(self, "on_step_end", *results)  # the results, not their list: that is shared (see the test)

    def on_finish(self, seq, now):
        _fire(self, "on_finish", seq)



class FaultyBudget(TokenBudget):
    name = "faulty-budget"

    def limits(self, state):
        kind = _fire(self, "limits", state)
        if kind == "zero":
            return type(super().limits(state))(0, 0)
        if kind == "wrong_type":
            return (4, 16)
        return super().limits(state)

    def may_admit(self, seq, state):
        _fire(self, "may_admit", seq, state)
        return True


class FaultyPrefill(ChunkedPrefill):
    name = "faulty-prefill"

    def num_tokens(self, seq, tokens_left, scheduled):
        kind = _fire(self, "num_tokens", seq, *scheduled)
        n = super().num_tokens(seq, tokens_left, scheduled)
        if kind == "overrun":
            return seq.num_pending_tokens + tokens_left
        if kind == "negative":
            return -1
        if kind == "float":
            return float(n)
        return n


class FaultyPreemption(Recompute):
    name = "faulty-preemption"

    def choose_victim(self, candidates, queue, now):
        kind = _fire(self, "choose_victim", *candidates)
        if kind == "stranger":
            return object()
        return super().choose_victim(candidates, queue, now)


class FaultySwap(FaultyPreemption, Swap):
    name = "faulty-swap"
    Params = SwapParams


class FaultyFifo(SchedulerPlugin):
    """A plain whole scheduler (up to 4 at once, whole prompts, no preemption) with faults."""

    name = "faulty-fifo"

    def __init__(self, params, blocks):
        super().__init__(params, blocks)
        self.waiting = deque()
        self.running = []
        self.done = []
        self.faults = None

    def add(self, seq):
        self.waiting.append(seq)

    def snapshot(self):
        waiting, running, done = list(self.waiting), list(self.running), list(self.done)

        def restore():
            self.waiting, self.running, self.done = deque(waiting), running, done

        return restore


    def schedule(self):
        kind = _fire(self, "schedule")
        if kind == "wrong_type":
            return None
        if kind == "empty":
            return SchedulerOutput()
        while self.waiting and len(self.running) < 4 and self.blocks.can_grow(self.waiting[0], 16):
            seq = self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        out = SchedulerOutput()
        for seq in self.running:
            n = seq.num_pending_tokens
            if self.blocks.try_grow(seq, n):
                out.scheduled.append(ScheduledSeq(seq, n))
        if kind == "twice" and out.scheduled:
            out.scheduled.append(out.scheduled[0])
        if kind == "overrun" and out.scheduled:
            out.scheduled[0] = ScheduledSeq(out.scheduled[0].seq, out.scheduled[0].num_tokens + 3)
        if kind == "no_blocks" and self.waiting:
            seq = self.waiting[0]
            seq.status = SequenceStatus.RUNNING
            out.scheduled.append(ScheduledSeq(seq, seq.num_pending_tokens))
        if kind == "finished" and self.done:
            out.scheduled.append(ScheduledSeq(self.done[0], 1))
        return out

    def on_step_end(self, output, results):
        for seq in [s for s in self.running if s.is_finished]:
            self.running.remove(seq)
            self.blocks.free(seq)
            self.done.append(seq)

    def abort(self, request_id):
        for group in (self.waiting, self.running):
            for seq in list(group):
                if seq.request_id == request_id:
                    group.remove(seq)
                    self.blocks.free(seq)
                    return seq
        return None
