"""Calling plugin code the way cbcore's engine does: exceptions and bad answers become named errors.

cbcore's engine turns an exception out of a policy into a ``SchedulerError``
naming the policy (``queue policy 'x' (path ./x.py)``), the method and the
request, found from the traceback (``cbcore.scheduling.blame``), and a bad
answer into a ``SchedulerError`` naming the rule it broke. The adapter uses
the same pieces and words, so a plugin misbehaving inside vLLM reads the same.
Unlike cbcore's engine, vLLM cannot undo a half-planned step: the error stops
its engine (a plugin bug is not a per-request condition).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NoReturn, TypeVar

from cbcore_vllm._cbcore import Policy, SchedulerError, blame

T = TypeVar("T")


class Guard:
    def __init__(self, names: Mapping[int, str]) -> None:
        self.names = names

    def call(self, fn: Callable[..., T], *args: Any, request_id: str | None = None) -> T:
        try:
            return fn(*args)
        except SchedulerError:
            raise
        except Exception as exc:
            raise self.named(exc, request_id) from exc

    def named(self, exc: BaseException, request_id: str | None = None) -> BaseException:
        """``exc`` as a SchedulerError naming the plugin frame it came from (else unchanged)."""
        if isinstance(exc, SchedulerError):
            return exc
        found = blame(exc, self.names)
        if found is None:
            return exc
        plugin, method, blamed = found
        rid = blamed or request_id
        about = f" for request {rid!r}" if rid else ""
        err = SchedulerError(
            f"{plugin} raised in {method}(){about}: {type(exc).__name__}: {exc}",
            plugin=plugin,
            rule=f"{method}() raised",
            request_id=rid,
        )
        err.__cause__ = exc
        return err

    def broke(self, policy: Policy, rule: str, detail: str, request_id: str | None = None) -> NoReturn:
        culprit = self.names[id(policy)]
        raise SchedulerError(
            f"{culprit} broke the rule '{rule}': {detail}", plugin=culprit, rule=rule, request_id=request_id
        )


def not_a_permutation(ordered: object, given: list[Any]) -> str | None:
    """Why ``ordered`` is not each of ``given`` exactly once (by identity), or None when it is."""
    if not isinstance(ordered, list | tuple):
        return f"got {type(ordered).__name__}"
    ids = [id(x) for x in ordered]
    if len(ids) == len(given) and set(ids) == {id(x) for x in given}:
        return None
    seen: set[int] = set()
    for x in ordered:
        if id(x) in seen:
            return f"{getattr(x, 'request_id', x)!r} appears {ids.count(id(x))} times"
        seen.add(id(x))
    known = {id(x) for x in given}
    extra = [x for x in ordered if id(x) not in known]
    if extra:
        return f"{getattr(extra[0], 'request_id', extra[0])!r} was not given"
    return f"{len(ordered)} sequences back for {len(given)} given"
