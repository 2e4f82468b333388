"""Policies that misbehave for the one request whose ``attrs`` ask (``{"do": ...}``), for the `cb serve` tests.

Loaded by `cb serve` from this file's path (``plugins:`` in the config), as a
user's plugin file is. Every other request is served first come, first
served, with a token budget. What ``do`` asks:

* ``exit``, ``interrupt``, ``memory``, ``raise``: ``key()`` raises SystemExit,
  KeyboardInterrupt, MemoryError or a RuntimeError whose text holds every
  request id the policy has seen and this file's path;
* ``raise_on_arrival``: ``on_arrival()`` raises such a RuntimeError;
* ``stop``: the budget's ``limits()`` raises while the request waits (a call
  about no single request);
* ``sleep`` (seconds in ``attrs["s"]``): ``key()`` sleeps, once;
* ``write``: every write to what ``key()``, ``may_admit()`` and
  ``on_step_end()`` are handed, and to every view kept from earlier requests
  (finished ones included), is tried and noted in the report file; then
  ``on_step_end()`` raises the first refusal.
"""

from __future__ import annotations

import json
import time

from pydantic import BaseModel

from cbcore import QueuePolicy, hookimpl
from cbcore.policies.token_budget import TokenBudget, TokenBudgetParams
from cbcore.testing.writes import try_writes


class QueueParams(BaseModel):
    report: str  # a JSON-lines file: what the policies did (a sleep's start, each write tried)


class BudgetParams(TokenBudgetParams):
    report: str


def note(path: str, **record: object) -> None:
    with open(path, "a") as fh:
        fh.write(json.dumps(record) + "\n")


def trespass(report: str, where: str, handed: dict[str, object]) -> BaseException | None:
    """Try every write to ``handed`` (by label), note each; returns the first refusal."""
    first = None
    for label, obj in handed.items():
        for what, refused in try_writes(obj, label, depth=3):
            note(report, where=where, what=what, refused=None if refused is None else type(refused).__name__)
            first = first or refused
    return first


class Mischief(QueuePolicy):
    name = "mischief"
    Params = QueueParams

    def __init__(self, params: QueueParams) -> None:
        super().__init__(params)
        self.kept: dict[str, object] = {}  # every view it was handed, kept after its request has ended
        self.slept: set[str] = set()

    def key(self, seq, now):
        self.kept[seq.request_id] = seq
        do = seq.attrs.get("do")
        if do == "exit":
            raise SystemExit(3)
        if do == "interrupt":
            raise KeyboardInterrupt
        if do == "memory":
            raise MemoryError(f"no memory to order {sorted(self.kept)} ({__file__})")
        if do == "raise":
            raise RuntimeError(f"cannot order {sorted(self.kept)} ({__file__})")
        if do == "sleep" and seq.request_id not in self.slept:
            self.slept.add(seq.request_id)
            note(self.params.report, slept_from=time.time(), request_id=seq.request_id)
            time.sleep(seq.attrs["s"])
        if do == "write":
            self.trespass("key", {"seq": seq})
        return (seq.arrival_time, seq.request_id)

    def on_arrival(self, seq, now):
        if seq.attrs.get("do") == "raise_on_arrival":
            raise RuntimeError(f"cannot take {seq.request_id} beside {sorted(self.kept)} ({__file__})")

    def on_step_end(self, results, now):
        mine = [r for r in results if r.seq.attrs.get("do") == "write"]
        if mine:
            raise self.trespass("on_step_end", {f"results[{i}]": r for i, r in enumerate(mine)})

    def trespass(self, where: str, handed: dict[str, object]) -> BaseException | None:
        """Writes to what was handed and to every view kept (each labelled with its status, read now)."""
        kept = {f"kept {rid} ({view.status})": view for rid, view in self.kept.items()}
        return trespass(self.params.report, where, {**handed, **kept})


class MischiefBudget(TokenBudget):
    name = "mischief-budget"
    Params = BudgetParams

    def limits(self, state):
        if any(view.attrs.get("do") == "stop" for view in state.waiting):
            raise RuntimeError(f"no limits with {[v.request_id for v in state.running]} running ({__file__})")
        return super().limits(state)

    def may_admit(self, seq, state):
        if seq.attrs.get("do") == "write":
            trespass(self.params.report, "may_admit", {"seq": seq, "state": state})
        return super().may_admit(seq, state)


@hookimpl
def cbcore_register_policies():
    return [Mischief, MischiefBudget]
