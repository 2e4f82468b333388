"""The one door between a scheduler and its four policies: every call, its check, and who failed.

A policy is outside code: whatever it returns or raises, the engine must stay
correct and every other request must be served. So each question is asked
here, and each answer checked here, once; and because the door knows which
policy it called, which method and which request the call concerned, a
failure is attributed without guessing. It becomes a :class:`PolicyError`
naming all three: the engine ends that request alone and plans the step
again without it (:mod:`cbcore.scheduling.step`). A call that concerns no
single request (``limits``), or whose failure the door cannot narrow to one,
raises a :class:`PolicyError` without a request: the engine stops, loudly.

Which request a call concerns: ``key``, ``may_admit``, ``num_tokens`` and the
events about one sequence concern that sequence. ``order``, ``outranks``,
``choose_victim`` and ``on_step_end`` take several; when one of those raises,
the door asks again one request at a time and blames the first whose call
raises alone (an ``on_step_end`` asked again may see some results twice).

Everything a policy raises is the policy's, ``SystemExit`` and
``KeyboardInterrupt`` included, except a signal the process received
(:func:`interrupted`: Ctrl-C, SIGTERM), which stays a shutdown, and a
``MemoryError``, which stops the engine. An application tells a signal
apart by setting :data:`SIGNALLED` in its handler; without one, a
KeyboardInterrupt on the main thread is taken for a Ctrl-C and anything else
for the plugin's. Policies get read-only views
(``seq.view``, ``blocks.view``), never the engine's objects.
"""

from __future__ import annotations

import inspect
import signal
import threading
from collections import Counter
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from operator import attrgetter
from typing import Any, NoReturn

from cbcore.log import get_logger
from cbcore.scheduling.policy import (
    BudgetPolicy,
    PreemptionPolicy,
    PrefillPolicy,
    QueuePolicy,
    SchedulerState,
    StepLimits,
    StepResult,
    _Policy,
)
from cbcore.scheduling.scheduler import SchedulerError
from cbcore.scheduling.sequence import Sequence

log = get_logger(__name__)
_stored_key = attrgetter("queue_key")
#: Set by the application's signal handlers (``cb``: :func:`cbcore.cli.main.opt_in_process_settings`).
SIGNALLED = threading.Event()

SLOTS = ("queue", "budget", "prefill", "preemption")
EVENTS = ("on_arrival", "on_step_end", "on_finish")

#: Names that left the policy API, with what replaces them: a plugin that still sets one is refused.
REMOVED = {
    "fixed_keys": "remove it: the scheduler asks key() every step it needs the order",
    "preempts_running": "override outranks(a, b, now) instead; it answers False by default (no preemptive admission)",
    "reads_cached_prefix": "remove it: a waiting sequence's num_cached_prompt_tokens is looked up when it is read",
    "begin_step": "remove it: num_tokens(seq, tokens_left, scheduled) sees what the step already holds",
    "on_preempt": "override on_step_end: a preempted sequence arrives there with StepResult.preempted set",
    "policy_state": "keep per-request state on the policy, keyed by request_id",
}
REMOVED_BY_KIND = {
    "prefill": {"order": "the phase order is scheduler configuration now: scheduler.order (decode-first or prefill-first)"},
    "preemption": {"mode": "mode is configuration now: a `mode` field in the policy's Params (recompute or swap)"},
}


class PolicyError(SchedulerError):
    """A policy raised, or answered against a rule. ``request_id``: the request the call concerned
    (None: no single one, the engine stops); ``public``: what a client may be shown (no other
    request's id, no server path)."""

    def __init__(self, message: str, *, plugin: str, rule: str, request_id: str | None, public: str) -> None:
        super().__init__(message, plugin=plugin, rule=rule, request_id=request_id)
        self.public = public


def describe(plugin: object, origin: str | None = None) -> str:
    """``queue policy 'fcfs' (built-in)``."""
    kind = getattr(plugin, "kind", "plugin")
    label = "scheduler" if kind == "scheduler" else f"{kind} policy"
    return f"{label} {getattr(plugin, 'name', type(plugin).__name__)!r}" + (f" ({origin})" if origin else "")


def interrupted(exc: BaseException) -> bool:
    """Whether ``exc`` (raised now) is the process being stopped by a signal: a shutdown, nobody's fault."""
    if not isinstance(exc, KeyboardInterrupt | SystemExit):
        return False
    if SIGNALLED.is_set():
        return True
    default = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    return isinstance(exc, KeyboardInterrupt) and default and threading.current_thread() is threading.main_thread()


def raise_named(name: str, method: str, request_id: str | None, exc: BaseException) -> NoReturn:
    """Raise ``exc``, raised by plugin ``name`` in ``method`` about ``request_id``, as the PolicyError naming them."""
    if isinstance(exc, PolicyError) or interrupted(exc):
        raise exc
    if isinstance(exc, MemoryError):
        request_id = None  # the process is out of memory: stopping beats guessing whom to blame
    what = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    about = f" for request {request_id!r}" if request_id else ""
    public = f"{name.split(' (')[0]} raised {type(exc).__name__} in {method}()"
    raise PolicyError(f"{name} raised in {method}(){about}: {what}", plugin=name, rule=f"{method}() raised",
                      request_id=request_id, public=public) from exc  # fmt: skip


def _overrides(policy: object, method: str) -> bool:
    return getattr(type(policy), method) is not getattr(_Policy, method)


class Door:
    """``queue``, ``budget``, ``prefill`` and ``preemption``, asked only through these methods."""

    def __init__(
        self, queue: QueuePolicy, budget: BudgetPolicy, prefill: PrefillPolicy, preemption: PreemptionPolicy,
        origins: Mapping[str, str] | None = None,
    ) -> None:  # fmt: skip
        self.queue, self.budget, self.prefill, self.preemption = queue, budget, prefill, preemption
        self.policies = (queue, budget, prefill, preemption)
        origins = origins or {}
        self.names = {id(p): describe(p, origins.get(slot)) for slot, p in zip(SLOTS, self.policies, strict=True)}
        for policy, expected in zip(self.policies, (QueuePolicy, BudgetPolicy, PrefillPolicy, PreemptionPolicy), strict=True):
            if not isinstance(policy, expected):
                raise TypeError(f"{self.names[id(policy)]} is not a {expected.__name__}")
            gone = REMOVED | REMOVED_BY_KIND.get(policy.kind, {})
            if used := [n for n in gone if n in vars(policy) or any(n in vars(c) for c in type(policy).__mro__[:-1]
                                                                      if c.__module__ != _Policy.__module__)]:
                raise TypeError(f"{self.names[id(policy)]} sets {used[0]!r}, which cbcore no longer reads: {gone[used[0]]}")
        if "batch_empty" in inspect.signature(prefill.num_tokens).parameters:  # the old meaning, inverted
            raise TypeError(f"{self.names[id(prefill)]}: num_tokens(seq, tokens_left, batch_empty) is now "
                            "num_tokens(seq, tokens_left, scheduled): batch_empty is `not scheduled`")  # fmt: skip
        self.mode = getattr(preemption.params, "mode", "recompute")
        if self.mode not in ("recompute", "swap"):
            raise ValueError(f"{self.names[id(preemption)]}: mode must be 'recompute' or 'swap', got {self.mode!r}")
        self.fixed_keys = bool(queue._fixed_keys)
        self.sorts_by_key = type(queue).order is QueuePolicy.order
        # Only the policies that override an event hear it: the others' no-ops cost nothing per step.
        self.hearing = {event: [p for p in self.policies if _overrides(p, event)] for event in EVENTS}
        # (sequence, plugin, what) while a watchdog finds a call about that sequence running past its bound: _late
        self.overdue: tuple[Sequence, str, str] | None = None

    @property
    def culprit(self) -> str:
        """All four, for a rule no single policy broke (a stall)."""
        return ", ".join(self.names[id(p)] for p in self.policies)

    # -- failures ------------------------------------------------------------

    def _raise(self, policy: object, method: str, seq: Any, exc: BaseException) -> NoReturn:
        """``exc`` (raised by ``policy.method`` about ``seq``, a sequence or its view) as the PolicyError naming them."""
        raise_named(self.names[id(policy)], method, None if seq is None else seq.request_id, exc)

    def _broke(self, policy: object, rule: str, detail: str, seq: Any = None) -> NoReturn:
        name, rid = self.names[id(policy)], getattr(seq, "request_id", None)
        public = f"{name.split(' (')[0]} broke the rule '{rule}'"
        raise PolicyError(f"{name} broke the rule '{rule}': {detail}", plugin=name, rule=rule, request_id=rid,
                          public=public)  # fmt: skip

    def _narrow(self, policy: object, method: str, seqs: Seq[Any], ask: Any, exc: BaseException) -> NoReturn:
        """A call about several sequences raised: the first whose call alone raises is to blame."""
        if not interrupted(exc) and not isinstance(exc, MemoryError):
            for seq in seqs:
                try:
                    ask(seq)
                except BaseException as alone:
                    self._raise(policy, method, seq, alone)
        self._raise(policy, method, None, exc)

    def _late(self, seq: Sequence) -> None:
        """A call about ``seq`` returned while ``overdue`` is set: if it named ``seq``, its request fails now."""
        late, plugin, what = self.overdue or (None, "", "")
        if late is seq:
            self.overdue = None
            raise PolicyError(f"{plugin}: {what} (request {seq.request_id!r})", plugin=plugin, rule=what,
                              request_id=seq.request_id, public=f"{plugin.split(' (')[0]}: {what}")  # fmt: skip

    # -- answers -------------------------------------------------------------

    def limits(self, state: SchedulerState) -> StepLimits:
        budget = self.budget
        try:
            limits = budget.limits(state)
        except BaseException as exc:
            self._raise(budget, "limits", None, exc)
        counts = (limits.max_num_seqs, limits.max_num_tokens) if isinstance(limits, StepLimits) else ()
        if not counts or not all(type(n) is int and n >= 1 for n in counts):
            self._broke(budget, "limits() returns StepLimits of two ints >= 1", f"got {limits!r}")
        return limits

    def _ask(self, policy: Any, method: str, seq: Sequence, *args: Any, then: Any = None) -> Any:
        """``policy.method(seq.view, *args)`` (passed through ``then`` inside the guard): a failure, or a
        return after the watchdog gave up on the call, names ``seq``."""
        try:
            answer = getattr(policy, method)(seq.view, *args)
            answer = answer if then is None else then(answer)
        except BaseException as exc:
            self._raise(policy, method, seq, exc)
        if self.overdue:
            self._late(seq)
        return answer

    def may_admit(self, seq: Sequence, state: SchedulerState) -> bool:
        return self._ask(self.budget, "may_admit", seq, state, then=bool)

    def num_tokens(self, seq: Sequence, tokens_left: int, scheduled: Seq[Any]) -> int:
        """Pending tokens of ``seq`` to run now; more than is pending means all of it (documented)."""
        pending = len(seq.token_ids) - seq.num_computed_tokens
        if pending == 1:
            return 1
        n = self._ask(self.prefill, "num_tokens", seq, tokens_left, tuple(scheduled))
        if type(n) is not int or n < 0:
            self._broke(self.prefill, "num_tokens() returns an int >= 0", f"got {n!r}", seq)
        if n > tokens_left and scheduled:
            rule = "num_tokens() stays within tokens_left (only a prompt alone in a step may exceed it)"
            self._broke(self.prefill, rule, f"{n} tokens for {seq.request_id!r} with {tokens_left} left", seq)
        return min(n, pending)

    def key(self, seq: Sequence, now: float) -> Any:
        return self._ask(self.queue, "key", seq, now)

    def order(self, seqs: Seq[Sequence], now: float) -> list[Sequence]:
        """``seqs`` in queue order (a new list): by stored keys, by ``key()``, or by the queue's own ``order()``."""
        queue = self.queue
        if self.fixed_keys:
            return sorted(seqs, key=_stored_key)
        if self.sorts_by_key:  # ask key() here, so that a failure names its sequence
            keyed = []
            for i, seq in enumerate(seqs):
                try:
                    keyed.append((queue.key(seq.view, now), i, seq))
                except BaseException as exc:
                    self._raise(queue, "key", seq, exc)
                if self.overdue:
                    self._late(seq)
            try:
                keyed.sort()
            except BaseException as exc:  # keys that do not compare
                self._raise(queue, "key", None, exc)
            return [seq for _, _, seq in keyed]
        views = [s.view for s in seqs]
        try:
            ordered = queue.order(views, now)
        except BaseException as exc:
            self._narrow(queue, "order", seqs, lambda s: queue.order([s.view], now), exc)
        of = {id(s.view): s for s in seqs}
        if not isinstance(ordered, list | tuple) or len(ordered) != len(seqs) or {id(v) for v in ordered} != set(of):
            self._broke(queue, "order() returns each given sequence exactly once", _not_a_permutation(ordered, views))
        return [of[id(v)] for v in ordered]

    def outranks(self, a: Sequence, b: Sequence, now: float) -> bool:
        queue = self.queue
        try:
            return bool(queue.outranks(a.view, b.view, now))
        except BaseException as exc:
            self._narrow(queue, "outranks", (a, b), lambda s: queue.outranks(s.view, s.view, now), exc)

    def victim(self, candidates: list[Sequence], now: float) -> Sequence:
        policy, queue = self.preemption, self.queue
        try:
            chosen = policy.choose_victim(tuple(s.view for s in candidates), queue, now)
        except BaseException as exc:
            self._narrow(policy, "choose_victim", candidates, lambda s: policy.choose_victim((s.view,), queue, now), exc)
        for seq in candidates:
            if seq.view is chosen:
                return seq
        detail = f"it chose {getattr(chosen, 'request_id', chosen)!r}, which is not among the candidates"
        self._broke(policy, "choose_victim() returns one of the candidates", detail)

    # -- events (after the step commits) -------------------------------------

    def arrived(self, seq: Sequence, now: float) -> None:
        """Tell every policy; if one raises, those told already see it finish, then the error names it."""
        told: list[_Policy] = []
        for policy in self.hearing["on_arrival"]:
            try:
                policy.on_arrival(seq.view, now)
                if self.overdue:
                    self._late(seq)
            except BaseException as exc:
                for earlier in told:
                    try:
                        earlier.on_finish(seq.view, now)
                    except BaseException as also:
                        self._event_failure(earlier, "on_finish", seq, also)
                self._raise(policy, "on_arrival", seq, exc)
            told.append(policy)

    def step_ended(self, results: Seq[StepResult], now: float) -> list[PolicyError]:
        """Every policy hears the step (as a tuple: one policy cannot change what the next hears); returns the failures."""
        failures, results = [], tuple(results)
        for policy in self.hearing["on_step_end"]:
            try:
                policy.on_step_end(results, now)
            except BaseException as exc:
                try:
                    self._narrow(policy, "on_step_end", [r.seq for r in results],
                                 lambda view, p=policy: p.on_step_end([r for r in results if r.seq is view], now), exc)  # fmt: skip
                except PolicyError as err:
                    log.error("policy event failed", plugin=err.plugin, method="on_step_end",
                              request_id=err.request_id, error=str(err), exc_info=exc)  # fmt: skip
                    failures.append(err)
        return failures

    def finished(self, seq: Sequence, now: float) -> list[PolicyError]:
        """Every policy hears that ``seq`` ended; returns the failures (logged: the request has ended already)."""
        failures = []
        for policy in self.hearing["on_finish"]:
            try:
                policy.on_finish(seq.view, now)
            except BaseException as exc:
                failures.append(self._event_failure(policy, "on_finish", seq, exc))
        return failures

    def _event_failure(self, policy: object, method: str, seq: Sequence, exc: BaseException) -> PolicyError:
        try:
            self._raise(policy, method, seq, exc)
        except PolicyError as err:
            log.error("policy event failed", plugin=err.plugin, method=method, request_id=seq.request_id,
                      error=str(err), exc_info=exc)  # fmt: skip
            return err


class GuardedScheduler:
    """A whole-scheduler plugin behind its door: what it raises is named after it.

    It is one plugin, so an exception out of any of its methods is its own:
    about the request being added or aborted, else about no single request.
    Anything else the plugin offers (its own queues, for a test) reads through.
    """

    def __init__(self, plugin: Any, name: str) -> None:
        self.plugin, self.name, self.blocks = plugin, name, plugin.blocks
        self.names = {id(plugin): name}

    def __getattr__(self, attr: str) -> Any:
        value = getattr(self.plugin, attr)
        if attr not in ("add", "abort", "schedule", "on_step_end", "snapshot"):
            return value

        def guarded(*args: Any) -> Any:
            try:
                return value(*args)
            except BaseException as exc:
                about = args[0] if attr in ("add", "abort") else None
                raise_named(self.name, attr, getattr(about, "request_id", about), exc)

        return guarded


def _not_a_permutation(ordered: object, given: Seq[Any]) -> str:
    if not isinstance(ordered, list | tuple):
        return f"got {type(ordered).__name__}"
    times, known = Counter(map(id, ordered)), {id(s) for s in given}
    if odd := next((s for s in ordered if times[id(s)] > 1 or id(s) not in known), None):
        what = "was not given" if id(odd) not in known else f"appears {times[id(odd)]} times"
        return f"{getattr(odd, 'request_id', odd)!r} {what}"
    return f"{len(ordered)} sequences back for {len(given)} given"
