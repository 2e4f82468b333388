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
from cbcore.scheduling.policy import PrefillPolicy, StepLimits
from cbcore.scheduling.sampling_params import SamplingParams
from cbcore.scheduling.sequence import Sequence


def seqs(*rids: str) -> list[Sequence]:
    return [Sequence(rid, [1, 2], SamplingParams()) for rid in rids]


def door(queue=None, budget=None, prefill=None) -> Door:
    return Door(queue or FCFS(), budget or TokenBudget(), prefill or ChunkedPrefill(), Recompute())


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


class FixedKeysMixin:
    fixed_keys = True


class MixesInFixedKeys(FCFS, FixedKeysMixin):  # the mixin comes last in the MRO, before object
    name = "mixes-in-fixed-keys"


@pytest.mark.parametrize("cls", [ClassLevelFixedKeys, InheritsFixedKeys, MixesInFixedKeys])
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


class Answers(PrefillPolicy):
    """Answers ``answer`` to every num_tokens() question, and remembers whom it was asked about."""

    name = "answers"

    def __init__(self, answer: object) -> None:
        super().__init__()
        self.answer, self.asked = answer, []

    def num_tokens(self, seq, tokens_left, scheduled):
        self.asked.append(seq.request_id)
        return self.answer


def computed(rid: str, length: int, done: int) -> Sequence:
    seq = Sequence(rid, list(range(1, length + 1)), SamplingParams())
    seq.num_computed_tokens = done
    return seq


@pytest.mark.parametrize("answer", [0, 5])
def test_a_sequence_with_one_pending_token_runs_it_without_asking_the_prefill_policy(answer) -> None:
    prefill = Answers(answer)
    d = door(prefill=prefill)
    assert d.num_tokens(computed("decode", 5, 4), 8, ()) == 1
    assert d.num_tokens(computed("first", 1, 0), 8, ()) == 1  # a one-token prompt
    assert prefill.asked == []


@pytest.mark.parametrize(("length", "done"), [(10, 4), (6, 4), (3, 0)])
def test_a_prefill_answer_above_what_is_pending_runs_all_that_is_pending(length, done) -> None:
    prefill = Answers(100)
    assert door(prefill=prefill).num_tokens(computed("p", length, done), 8, ()) == length - done
    assert prefill.asked == ["p"]
    assert door(prefill=Answers(0)).num_tokens(computed("p", length, done), 8, ()) == 0  # not this step


@pytest.mark.parametrize("answer", [-1, -2, 2.5, "3", None, True])
def test_num_tokens_must_answer_an_int_of_at_least_zero(answer) -> None:
    with pytest.raises(PolicyError, match=r"num_tokens\(\) returns an int >= 0") as caught:
        door(prefill=Answers(answer)).num_tokens(computed("p", 10, 0), 8, ())
    assert caught.value.request_id == "p"


class Hears(FCFS):
    """Records the arrivals and finishes it hears."""

    name = "hears"
    _fixed_keys = False  # asked every step

    def __init__(self) -> None:
        super().__init__()
        self.arrived, self.finished = [], []

    def on_arrival(self, seq, now):
        self.arrived.append(seq.request_id)

    def on_finish(self, seq, now):
        self.finished.append(seq.request_id)


ASKED = {
    "may_admit": lambda d, seq: d.may_admit(seq, None),
    "key": lambda d, seq: d.key(seq, 0.0),
    "num_tokens": lambda d, seq: d.num_tokens(seq, 8, ()),
    "on_arrival": lambda d, seq: d.arrived(seq, 0.0),
}


@pytest.mark.parametrize("question", list(ASKED))
def test_any_question_about_a_sequence_answered_after_the_watchdog_gave_up_fails_that_request(question) -> None:
    a, b = seqs("a", "b")
    d = door(Hears())
    ASKED[question](d, a)  # nothing overdue: nothing fails
    d.overdue = (b, "queue policy 'hears'", "took longer than the watchdog's bound")
    ASKED[question](d, a)  # overdue about another request: this one is answered
    assert d.overdue is not None
    with pytest.raises(PolicyError, match=r"took longer than the watchdog's bound \(request 'b'\)") as caught:
        ASKED[question](d, b)
    assert caught.value.request_id == "b" and d.overdue is None


def test_the_policies_told_of_an_arrival_hear_it_finish_when_a_later_one_refuses_it() -> None:
    queue = Hears()
    with pytest.raises(PolicyError, match=r"budget policy 'refuses-arrivals' raised in on_arrival\(\)"):
        door(queue, RefusesArrivals()).arrived(seqs("a")[0], 0.0)
    assert queue.arrived == ["a"] and queue.finished == ["a"]


def test_an_on_finish_that_raises_is_returned_as_that_policys_failure_about_the_request() -> None:
    (failure,) = door(ForgetsBadly()).finished(seqs("a")[0], 0.0)
    assert isinstance(failure, PolicyError) and failure.request_id == "a"
    assert failure.plugin == "queue policy 'forgets-badly'" and failure.rule == "on_finish() raised"
    assert door(Hears()).finished(seqs("a")[0], 0.0) == []


class OrderRaises(FCFS):
    """An order() that raises ``exc`` every time, counting the calls."""

    name = "order-raises"
    _fixed_keys = False  # asked every step

    def __init__(self, exc: BaseException) -> None:
        super().__init__()
        self.exc, self.calls = exc, 0

    def order(self, views, now):
        self.calls += 1
        raise self.exc


def test_a_policy_out_of_memory_stops_the_engine_without_being_asked_again_request_by_request() -> None:
    queue = OrderRaises(MemoryError())
    with pytest.raises(PolicyError, match=r"raised in order\(\): MemoryError") as caught:
        door(queue).order(seqs("a", "b", "c"), 0.0)
    assert caught.value.request_id is None and queue.calls == 1


def test_a_ctrl_c_during_a_policy_call_is_a_shutdown_without_asking_again(python_sigint) -> None:
    queue = OrderRaises(KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        door(queue).order(seqs("a", "b", "c"), 0.0)
    assert queue.calls == 1
    failing = OrderRaises(ValueError("cannot order"))  # the policy's own error: asked one at a time to name one
    with pytest.raises(PolicyError, match=r"raised in order\(\) for request 'a'"):
        door(failing).order(seqs("a", "b", "c"), 0.0)
    assert failing.calls == 2
