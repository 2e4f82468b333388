"""The four policies of a composed scheduler, called only through the checks of their answers.

A policy is outside code: whatever it returns, the scheduler must stay
correct. Each question is asked here, and each answer checked here, once:
an order that is not a permutation, limits that are not two positive ints,
a chunk size outside the budget, a victim that was not a candidate — each is
a :class:`SchedulerError` naming the policy, its origin and the rule. The
same object serves cbcore's scheduler and any other engine that lets these
policies decide (``cbcore_vllm``), so a plugin misbehaves the same way
everywhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as Seq
from typing import Any, NoReturn

from cbcore.config import SLOTS
from cbcore.log import get_logger
from cbcore.scheduling.policy import (
    BudgetPolicy,
    Policy,
    PreemptionPolicy,
    PrefillPolicy,
    QueuePolicy,
    SchedulerState,
    StepLimits,
    StepResult,
)
from cbcore.scheduling.scheduler import SchedulerError
from cbcore.scheduling.sequence import Sequence

log = get_logger(__name__)


def describe(plugin: object, origin: str | None = None) -> str:
    """``queue policy 'fcfs' (built-in)``."""
    kind = getattr(plugin, "kind", "plugin")
    label = "scheduler" if kind == "scheduler" else f"{kind} policy"
    return f"{label} {getattr(plugin, 'name', type(plugin).__name__)!r}" + (f" ({origin})" if origin else "")


class PolicySet:
    """``queue``, ``budget``, ``prefill`` and ``preemption``, with ``names`` (``id`` -> description)."""

    def __init__(
        self,
        queue: QueuePolicy,
        budget: BudgetPolicy,
        prefill: PrefillPolicy,
        preemption: PreemptionPolicy,
        origins: Mapping[str, str] | None = None,
    ) -> None:
        self.queue, self.budget, self.prefill, self.preemption = queue, budget, prefill, preemption
        origins = origins or {}
        self.names = {id(p): describe(p, origins.get(slot)) for slot, p in zip(SLOTS, self, strict=True)}
        for policy, expected in zip(self, (QueuePolicy, BudgetPolicy, PrefillPolicy, PreemptionPolicy), strict=True):
            if not isinstance(policy, expected):
                raise TypeError(f"{self.names[id(policy)]} is not a {expected.__name__}")
        if preemption.mode not in ("recompute", "swap"):
            raise ValueError(f"{self.names[id(preemption)]}: mode must be 'recompute' or 'swap', got {preemption.mode!r}")
        if prefill.order not in ("decode-first", "prefill-first"):
            raise ValueError(
                f"{self.names[id(prefill)]}: order must be 'decode-first' or 'prefill-first', got {prefill.order!r}"
            )

    def __iter__(self):
        return iter((self.queue, self.budget, self.prefill, self.preemption))

    @property
    def culprit(self) -> str:
        """All four, for a rule no single policy broke (a stall)."""
        return ", ".join(self.name_of(p) for p in self)

    def name_of(self, policy: Policy) -> str:
        return self.names.get(id(policy)) or describe(policy)

    def error(self, policy: Policy, rule: str, detail: str, seq: Any = None) -> NoReturn:
        culprit = self.name_of(policy)
        message = f"{culprit} broke the rule '{rule}': {detail}"
        raise SchedulerError(message, plugin=culprit, rule=rule, request_id=getattr(seq, "request_id", None))

    # -- questions -----------------------------------------------------------

    def order(self, seqs: Seq[Sequence], now: float) -> list[Sequence]:
        ordered = self.queue.order(seqs, now)
        if not isinstance(ordered, list | tuple) or len(ordered) != len(seqs) or set(ordered) != set(seqs):
            self.error(self.queue, "order() returns each given sequence exactly once", _not_a_permutation(ordered, seqs))
        return list(ordered)

    def limits(self, state: SchedulerState) -> StepLimits:
        limits = self.budget.limits(state)
        counts = (limits.max_num_seqs, limits.max_num_tokens) if isinstance(limits, StepLimits) else ()
        if not counts or not all(type(n) is int and n >= 1 for n in counts):
            self.error(self.budget, "limits() returns StepLimits of two ints >= 1", f"got {limits!r}")
        return limits

    def num_tokens(self, seq: Sequence, tokens_left: int, batch_empty: bool) -> int:
        """Pending tokens of ``seq`` to run now; more than is pending means all of it (documented)."""
        pending = seq.num_pending_tokens
        if pending == 1:
            return 1
        n = self.prefill.num_tokens(seq, tokens_left, batch_empty)
        if type(n) is not int or n < 0:
            self.error(self.prefill, "num_tokens() returns an int >= 0", f"got {n!r}", seq)
        if n > tokens_left and not batch_empty:
            rule = "num_tokens() stays within tokens_left (only a prompt alone in a step may exceed it)"
            self.error(self.prefill, rule, f"{n} tokens for {seq.request_id!r} with {tokens_left} left", seq)
        return min(n, pending)

    def victim(self, candidates: list[Sequence], now: float) -> Sequence:
        victim = self.preemption.choose_victim(candidates, self.queue, now)
        if not any(victim is c for c in candidates):
            detail = f"it chose {getattr(victim, 'request_id', victim)!r}, which is not among the candidates"
            self.error(self.preemption, "choose_victim() returns one of the candidates", detail)
        return victim  # type: ignore[return-value]

    # -- events --------------------------------------------------------------

    def arrived(self, seq: Sequence, now: float) -> None:
        """Tell every policy; if one raises, those told already see it finish (then re-raise)."""
        told: list[Policy] = []
        try:
            for policy in self:
                told.append(policy)
                policy.on_arrival(seq, now)
        except Exception:
            self.unarrive(seq, now, told)
            raise

    def unarrive(self, seq: Sequence, now: float, told: Seq[Policy] | None = None) -> None:
        """An arrival that did not happen after all: the policies that saw it see it finish."""
        for policy in self if told is None else told:
            try:
                policy.on_finish(seq, now)
            except Exception:  # the first error is the one to report
                log.warning("on_finish raised while undoing an arrival", policy=policy.name)

    def step_ended(self, results: Seq[StepResult], now: float) -> None:
        for policy in self:
            policy.on_step_end(results, now)

    def finished(self, seq: Sequence, now: float) -> None:
        for policy in self:
            policy.on_finish(seq, now)

    def preempted(self, seq: Sequence, now: float) -> None:
        for policy in self:
            policy.on_preempt(seq, now)


def _not_a_permutation(ordered: object, given: Seq[Sequence]) -> str:
    if not isinstance(ordered, list | tuple):
        return f"got {type(ordered).__name__}"
    if twice := [s for s in set(ordered) if ordered.count(s) > 1]:
        return f"{getattr(twice[0], 'request_id', twice[0])!r} appears {ordered.count(twice[0])} times"
    if extra := [s for s in ordered if s not in set(given)]:
        return f"{getattr(extra[0], 'request_id', extra[0])!r} was not given"
    return f"{len(ordered)} sequences back for {len(given)} given"
