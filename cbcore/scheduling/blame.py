"""Naming the plugin behind an error: which policy or scheduler, which method, which request.

An exception raised inside a plugin carries the plugin's frames in its
traceback. The engine looks there instead of wrapping every policy call, so
naming the culprit costs nothing on the steps that succeed.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import TracebackType

from cbcore.scheduling.sequence import Sequence


def describe(plugin: object, origin: str | None = None) -> str:
    """``queue policy 'fcfs' (built-in)``."""
    kind = getattr(plugin, "kind", "plugin")
    label = "scheduler" if kind == "scheduler" else f"{kind} policy"
    name = getattr(plugin, "name", type(plugin).__name__)
    return f"{label} {name!r}" + (f" ({origin})" if origin else "")


def blame(exc: BaseException, names: Mapping[int, str]) -> tuple[str, str, str | None] | None:
    """(plugin, method, request id) of the plugin frame the exception came from, or None.

    ``names`` maps ``id(plugin)`` to its description. The first plugin met
    from the outside is the one the engine or scheduler called; its innermost
    frame is the method that raised (``key`` rather than the ``order`` that
    called it). The request is one that method was looking at, else the one
    the scheduler was serving when it called it.
    """
    found: tuple[str, str, str | None] | None = None
    owner: object = None
    outer: str | None = None  # the request a frame outside the plugin was working on
    tb: TracebackType | None = exc.__traceback__
    while tb is not None:
        local = tb.tb_frame.f_locals
        obj = local.get("self")
        if obj is not None and (owner is None or obj is owner) and id(obj) in names:
            owner = obj
            request = _request_in(local) or (found[2] if found else None) or outer
            found = (names[id(obj)], tb.tb_frame.f_code.co_name, request)
        elif owner is None:
            outer = _request_in(local) or outer
        tb = tb.tb_next
    return found


def _request_in(local: Mapping[str, object]) -> str | None:
    for value in local.values():
        if isinstance(value, Sequence):
            return value.request_id
    return None
