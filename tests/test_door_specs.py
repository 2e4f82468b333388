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
from cbcore.scheduling.door import SIGNALLED, Door, PolicyError, interrupted
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
