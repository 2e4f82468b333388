"""Calling plugin code the way cbcore's engine does: an exception becomes a named error.

cbcore's engine turns an exception out of a policy into a ``SchedulerError``
naming the policy (``queue policy 'x' (path ./x.py)``), the method and the
request, found from the traceback (``cbcore.scheduling.step.named``); a bad
answer is refused by the ``PolicySet`` that asked. The adapter calls both, so
a plugin misbehaving inside vLLM reads the same. Unlike cbcore's engine, vLLM
cannot undo a half-planned step: the error stops its engine (a plugin bug is
not a per-request condition).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from cbcore_vllm._cbcore import named

T = TypeVar("T")


class Guard:
    def __init__(self, names: Mapping[int, str]) -> None:
        self.names = names

    def call(self, fn: Callable[..., T], *args: Any, request_id: str | None = None) -> T:
        try:
            return fn(*args)
        except Exception as exc:
            err = self.named(exc, request_id)
            if err is exc:
                raise
            raise err from exc

    def named(self, exc: BaseException, request_id: str | None = None) -> BaseException:
        """``exc`` as a SchedulerError naming the plugin frame it came from (else unchanged)."""
        return named(exc, self.names, request_id)
