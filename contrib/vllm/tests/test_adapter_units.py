"""The adapter's waiting queue and victim list as units: vLLM's calls made by hand, vLLM not started.

``PolicyRequestQueue`` and ``VictimList`` only subclass vLLM's ``RequestQueue``
and ``list`` and hold its ``Request`` objects without reading them, so their
contract -- the order the queue policy gives, the budget's refusals hidden
during a step, the preemption policy's victim answered on the read vLLM makes
-- is checked here with plain objects. Where vLLM is not installed (cbcore's
own venv), the two vLLM names they import are stood in for while they are
imported (and removed after, so no other test sees a ``vllm`` module). How
they behave inside vLLM's real scheduler is tested at the scheduler level on
each vLLM version (``scheduler_level/``).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass

import pytest


@dataclass(eq=False)  # identity, as vLLM's requests are compared
class Req:
    name: str
    key: int = 0

    def __repr__(self) -> str:
        return self.name


def _stand_ins() -> dict[str, types.ModuleType]:
    class RequestQueue:  # vLLM's is an abstract base with no state of its own
        pass

    class Request:
        pass

    modules = {name: types.ModuleType(name) for name in (
        "vllm", "vllm.v1", "vllm.v1.request", "vllm.v1.core", "vllm.v1.core.sched", "vllm.v1.core.sched.request_queue")}
    modules["vllm.v1.request"].Request = Request
    modules["vllm.v1.core.sched.request_queue"].RequestQueue = RequestQueue
    return modules


@pytest.fixture
def adapter(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.SimpleNamespace]:
    owned = ("cbcore_vllm.queue", "cbcore_vllm.running")
    if importlib.util.find_spec("vllm") is None:
        for name, module in _stand_ins().items():
            monkeypatch.setitem(sys.modules, name, module)
    for name in owned:
        monkeypatch.delitem(sys.modules, name, raising=False)
    queue, running = (importlib.import_module(name) for name in owned)
    yield types.SimpleNamespace(queue=queue, running=running)
    for name in owned:  # imported over stand-ins: no later test may get these
        sys.modules.pop(name, None)


class Policy:
    """A queue policy: by key, counting its calls (the adapter orders once per change of members)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, requests: list[Req]) -> list[Req]:
        self.calls += 1
        return sorted(requests, key=lambda r: r.key)


def test_the_queue_pops_in_the_policys_order_and_orders_once_per_change(adapter) -> None:
    policy = Policy()
    q = adapter.queue.PolicyRequestQueue(policy)
    a, b, c = Req("a", 2), Req("b", 0), Req("c", 1)
    for r in (a, b, c):
        q.add_request(r)
    assert len(q) == 3 and bool(q)
    assert q.peek_request() is b and q.peek_request() is b
    assert policy.calls == 1
    assert q.pop_request() is b
    assert q.pop_request() is c  # popping leaves the computed order valid
    assert policy.calls == 1
    d = Req("d", -1)
    q.add_request(d)
    assert q.peek_request() is d and policy.calls == 2
    assert list(q) == [d, a] and q.ordered() == [d, a]
    assert set(q.members()) == {a, d} and policy.calls == 2
    assert [q.pop_request(), q.pop_request()] == [d, a]
    assert len(q) == 0 and not q
    with pytest.raises(IndexError):
        q.pop_request()
    with pytest.raises(IndexError):
        q.peek_request()


def test_prepending_puts_a_request_where_the_policy_says_not_in_front(adapter) -> None:
    q = adapter.queue.PolicyRequestQueue(Policy())
    a, b, c = Req("a", 0), Req("b", 5), Req("c", 3)
    q.add_request(a)
    q.prepend_request(b)
    q.prepend_requests([c])
    assert list(q) == [a, c, b]


def test_removed_requests_leave_the_order_and_removing_a_stranger_is_an_error_only_alone(adapter) -> None:
    q = adapter.queue.PolicyRequestQueue(Policy())
    a, b, c = Req("a", 0), Req("b", 1), Req("c", 2)
    for r in (a, b, c):
        q.add_request(r)
    assert list(q) == [a, b, c]
    q.remove_request(a)
    assert list(q) == [b, c] and q.peek_request() is b
    q.remove_requests([b, Req("stranger")])
    assert list(q) == [c] and len(q) == 1
    with pytest.raises(KeyError):
        q.remove_request(a)


def test_during_a_step_refused_requests_are_hidden_and_each_is_asked_once(adapter) -> None:
    q = adapter.queue.PolicyRequestQueue(Policy())
    a, b, c = Req("a", 0), Req("b", 1), Req("c", 2)
    for r in (a, b, c):
        q.add_request(r)
    asked: list[Req] = []

    def admits(r: Req) -> bool:
        asked.append(r)
        return r is not b

    q.begin_step(admits)
    assert asked == []  # lazily: nothing asked before vLLM reads the queue
    assert q.peek_request() is a and q.peek_request() is a
    assert asked == [a]
    assert q.pop_request() is a
    assert q.peek_request() is c  # b is refused, so hidden
    assert q.pop_request() is c
    assert asked == [a, b, c]
    assert not q and len(q) == 1  # b still waits, though no step may take it
    with pytest.raises(IndexError):
        q.pop_request()
    assert asked == [a, b, c]  # a refusal holds for the step: b is not asked again
    q.end_step()
    assert q and list(q) == [b] and q.peek_request() is b  # outside a step every request is visible
    assert asked == [a, b, c]


def test_each_step_orders_afresh_and_asks_the_budget_again(adapter) -> None:
    keys = {"a": [0, 5], "b": [1, 1]}
    calls = 0

    def by_time(requests: list[Req]) -> list[Req]:  # a key that changes with time, as an aging policy's
        nonlocal calls
        calls += 1
        return sorted(requests, key=lambda r: keys[r.name][min(calls, 2) - 1])

    q = adapter.queue.PolicyRequestQueue(by_time)
    a, b = Req("a"), Req("b")
    q.add_request(a)
    q.add_request(b)
    refused = {a}
    q.begin_step(lambda r: r not in refused)
    assert q.peek_request() is b
    q.end_step()
    refused.clear()
    q.begin_step(lambda r: r not in refused)  # a new step: a new order, and a is asked again
    assert q.ordered() == [b, a]
    assert q.pop_request() is b and q.pop_request() is a


def running(adapter, cls_name: str, n: int, choose) -> tuple[list[Req], object]:
    reqs = [Req(f"r{i}") for i in range(n)]
    return reqs, getattr(adapter.running, cls_name)(reqs, choose)


def test_fcfs_victim_read_answers_the_policys_choice_among_the_asker_and_those_after_it(adapter) -> None:
    seen: list[list[Req]] = []

    def choose(candidates: list[Req]) -> Req:
        seen.append(list(candidates))
        return candidates[1]

    reqs, lst = running(adapter, "FcfsVictims", 5, choose)
    assert lst[-1] is reqs[4] and lst[0] is reqs[0] and seen == []  # nobody asking: a plain list
    lst.asks(reqs[2])
    assert lst[1] is reqs[1]  # only the victim read (index -1) is answered
    assert lst[-1] is reqs[3]
    assert seen == [reqs[2:]]
    assert lst.pop() is reqs[3]
    assert list(lst) == [reqs[0], reqs[1], reqs[2], reqs[4]]
    assert lst[-1] is reqs[4] and lst.pop() is reqs[4]  # answered once: then a plain list again
    assert len(seen) == 1


def test_fcfs_pop_of_another_index_or_after_settle_is_a_plain_pop(adapter) -> None:
    reqs, lst = running(adapter, "FcfsVictims", 4, lambda c: c[0])
    lst.asks(reqs[1])
    assert lst[-1] is reqs[1]
    assert lst.pop(0) is reqs[0]  # not the victim read: a plain pop, and the answer is forgotten
    assert lst.pop() is reqs[3]
    reqs, lst = running(adapter, "FcfsVictims", 4, lambda c: c[0])
    lst.asks(reqs[1])
    lst.settle()
    assert lst[-1] is reqs[3] and lst.pop() is reqs[3]
    lst.asks(reqs[0])
    assert lst[-1] is reqs[0]
    lst.settle()  # vLLM chose not to evict: the answer is forgotten
    assert lst.pop() is reqs[2]


def test_priority_victim_read_iterates_only_the_policys_choice(adapter) -> None:
    seen: list[list[Req]] = []

    def choose(candidates: list[Req]) -> Req:
        seen.append(list(candidates))
        return candidates[-1]

    reqs, lst = running(adapter, "PriorityVictims", 4, choose)
    assert list(lst) == reqs and seen == []
    lst.asks(reqs[1])
    victim = max(lst, key=lambda r: r.name)  # vLLM's read: one iteration
    assert victim is reqs[3] and seen == [reqs[1:]]
    del lst[lst.index(victim)]
    assert list(lst) == reqs[:3]  # then a plain list again
    lst.asks(reqs[2])
    lst.settle()
    assert list(lst) == reqs[:3] and len(seen) == 1
