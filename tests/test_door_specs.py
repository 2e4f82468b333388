"""The door's judgements at their edges: whose fault an exception is, and what each refusal names.

``interrupted`` tells the process being stopped (a Ctrl-C reaching the main
thread under Python's own handler, or a signal the application recorded)
from a plugin raising ``KeyboardInterrupt`` or ``SystemExit`` itself; the
door refuses a policy class that still sets a name the API dropped, on the
class as on the instance; keys that cannot be compared, and an ``on_finish``
failing while an arrival is taken back, are the policy's error by name.
"""

from __future__ import annotations

import signal
import threading

import pytest

from cbcore.policies import FCFS, ChunkedPrefill, Recompute, TokenBudget
from cbcore.scheduling.door import SIGNALLED, Door, GuardedScheduler, PolicyError, interrupted
from cbcore.scheduling.policy import StepLimits
from cbcore.scheduling.sampling_params import SamplingParams
from cbcore.scheduling.sequence import Sequence


def seqs(*rids: str) -> list[Sequence]:
    return [Sequence(rid, [1, 2], SamplingParams()) for rid in rids]


def door(queue=None, budget=None) -> Door:
    return Door(queue or FCFS(), budget or TokenBudget(), ChunkedPrefill(), Recompute())


@pytest.fixture
def python_sigint():
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    SIGNALLED.clear()
    yield
    signal.signal(signal.SIGINT, before)
    SIGNALLED.clear()


def in_thread(fn):
    got = []
    t = threading.Thread(target=lambda: got.append(fn()))
    t.start()
    t.join()
    return got[0]


def test_only_a_ctrl_c_under_pythons_handler_in_the_main_thread_is_the_process_being_stopped(python_sigint) -> None:
    assert interrupted(KeyboardInterrupt())
    assert not interrupted(SystemExit(0))  # a plugin calling sys.exit: its error
    assert not interrupted(RuntimeError())
    assert not in_thread(lambda: interrupted(KeyboardInterrupt()))  # no signal lands in another thread
    signal.signal(signal.SIGINT, lambda *_: None)  # the application handles Ctrl-C itself
    assert not interrupted(KeyboardInterrupt())
    SIGNALLED.set()  # ... and records the signal it received: then any of the two is the shutdown
    assert interrupted(KeyboardInterrupt()) and interrupted(SystemExit(0))
    assert not interrupted(RuntimeError())


class ClassLevelFixedKeys(FCFS):
    name = "class-level-fixed-keys"
    fixed_keys = True


class InheritsFixedKeys(ClassLevelFixedKeys):
    name = "inherits-fixed-keys"


@pytest.mark.parametrize("cls", [ClassLevelFixedKeys, InheritsFixedKeys])
def test_a_policy_class_that_sets_a_dropped_name_is_refused(cls) -> None:
    with pytest.raises(TypeError, match="sets 'fixed_keys', which cbcore no longer reads"):
        door(cls())


class MixedKeys(FCFS):
    name = "mixed-keys"
    _fixed_keys = False  # asked every step

    def key(self, seq, now):
        return seq.request_id if seq.request_id == "a" else 1


def test_keys_that_do_not_compare_are_the_queues_error_by_name() -> None:
    d = door(MixedKeys())
    with pytest.raises(PolicyError, match=r"queue policy 'mixed-keys' raised in key\(\): TypeError") as caught:
        d.order(seqs("a", "b"), 0.0)
    assert caught.value.rule == "key() raised" and caught.value.request_id is None


class Drops(FCFS):
    name = "drops"
    _fixed_keys = False  # asked every step

    def order(self, views, now):
        return list(views)[1:]


class Doubles(FCFS):
    name = "doubles"
    _fixed_keys = False  # asked every step

    def order(self, views, now):
        return [views[0], views[0], *views[2:]]


def test_an_order_that_is_not_a_permutation_says_what_is_wrong_with_it() -> None:
    with pytest.raises(PolicyError, match=r"2 sequences back for 3 given"):
        door(Drops()).order(seqs("a", "b", "c"), 0.0)
    with pytest.raises(PolicyError, match=r"'a' appears 2 times"):
        door(Doubles()).order(seqs("a", "b", "c"), 0.0)


class ForgetsBadly(FCFS):
    name = "forgets-badly"

    def on_arrival(self, seq, now):
        pass

    def on_finish(self, seq, now):
        raise RuntimeError("on_finish failed")


class RefusesArrivals(TokenBudget):
    name = "refuses-arrivals"

    def on_arrival(self, seq, now):
        raise ValueError("no arrivals")


def test_an_arrival_refused_by_one_policy_is_that_policys_error_even_if_taking_it_back_fails() -> None:
    d = door(ForgetsBadly(), RefusesArrivals())
    with pytest.raises(PolicyError, match=r"budget policy 'refuses-arrivals' raised in on_arrival\(\)") as caught:
        d.arrived(seqs("a")[0], 0.0)
    assert caught.value.request_id == "a"


class Limited(TokenBudget):
    name = "limited"

    def __init__(self, seqs: object, tokens: object) -> None:
        super().__init__()
        self.answer = (seqs, tokens)

    def limits(self, state):
        return StepLimits(*self.answer)


@pytest.mark.parametrize("answer", [(0, 8), (2, 0), (2.5, 8), (2, 8.0), (True, 8)])
def test_limits_must_be_two_ints_of_at_least_one(answer) -> None:
    with pytest.raises(PolicyError, match=r"limits\(\) returns StepLimits of two ints >= 1"):
        door(budget=Limited(*answer)).limits(None)
    assert door(budget=Limited(1, 1)).limits(None) == StepLimits(1, 1)


class KeyFails(FCFS):
    name = "key-fails"
    _fixed_keys = False

    def key(self, seq, now):
        if seq.request_id == "b":
            raise LookupError("no key for b")
        return seq.request_id


class OutranksFails(FCFS):
    name = "outranks-fails"

    def outranks(self, a, b, now):
        raise LookupError("cannot rank")


def test_a_key_or_outranks_that_raises_is_the_queues_error_about_the_request_it_concerned() -> None:
    a, b = seqs("a", "b")
    with pytest.raises(PolicyError, match=r"raised in key\(\) for request 'b'") as caught:
        door(KeyFails()).order([a, b], 0.0)
    assert caught.value.request_id == "b"
    with pytest.raises(PolicyError, match=r"raised in outranks\(\)") as caught:
        door(OutranksFails()).outranks(a, b, 0.0)
    assert caught.value.request_id == "a"


class Keyed(FCFS):
    name = "keyed"
    _fixed_keys = False  # asked every step


def test_a_call_that_returns_after_the_watchdog_marked_it_overdue_fails_its_request() -> None:
    a, b, c = seqs("a", "b", "c")
    d = door(Keyed())
    assert d.order([a, b, c], 0.0) == [a, b, c]  # nothing overdue: nothing fails
    d.overdue = (b, "queue policy 'keyed'", "took longer than the watchdog's bound")
    with pytest.raises(PolicyError, match=r"took longer than the watchdog's bound \(request 'b'\)") as caught:
        d.order([a, b, c], 0.0)
    assert caught.value.request_id == "b" and d.overdue is None


class WholePlugin:
    """A whole-scheduler plugin: its own methods, each raising."""

    blocks = None
    note = "read through"

    def add(self, seq):
        raise ValueError("add failed")

    def schedule(self):
        raise ValueError("schedule failed")

    def helper(self):
        raise ValueError("helper failed")


def test_a_whole_scheduler_plugins_failures_are_named_after_it_and_its_other_attributes_read_through() -> None:
    guarded = GuardedScheduler(WholePlugin(), "scheduler 'whole'")
    (seq,) = seqs("r")
    with pytest.raises(PolicyError, match=r"scheduler 'whole' raised in add\(\) for request 'r'") as caught:
        guarded.add(seq)
    assert caught.value.request_id == "r"
    with pytest.raises(PolicyError, match=r"raised in schedule\(\)") as caught:
        guarded.schedule()
    assert caught.value.request_id is None
    assert guarded.note == "read through"
    with pytest.raises(ValueError, match="helper failed"):  # not one of the scheduler's methods: not guarded
        guarded.helper()
