"""The engine thread's watchdog: a call that runs past ``serve.watchdog_s`` is named, reported and outlived.

A plugin is outside code, and nothing bounds how long a Python call takes: a
policy that sleeps, loops or waits on a lock holds the engine thread, and
with it every request in flight. The engine loop marks when it enters the
engine (a step, an arrival, an abort) and when it leaves. A monitor thread
looks every ``min(0.25 s, B / 4)``; once the engine has been inside for more
than B it reads the engine thread's stack (:func:`sys._current_frames`): the
innermost frame whose ``self`` is one of the scheduler's plugins and whose
caller is the door (or a whole scheduler's guard) is the call the engine
made, and names the plugin and the method; with no plugin frame at all the
stall is the engine's own.

The engine loop is told at once (:class:`~cbcore.serve.engine_loop.EngineLoop`
ends the requests in flight; ``/health``, ``/metrics`` and new requests say
so). When the call returns, the stall ends: a call about one request (``key``,
``may_admit``, ``num_tokens``, ``on_arrival``) fails that request as it
returns (the door's ``overdue``), the step is planned again without it, and the
engine serves on. A call that never returns leaves the server stalled until
it is restarted: a thread cannot be stopped from outside.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import FrameType
from typing import Any

from cbcore.log import get_logger
from cbcore.scheduling.sequence import Sequence
from cbcore.serve.failures import public_name, scheduler_names

log = get_logger(__name__)

ENGINE = "the engine"
#: The methods the engine calls on plugins: the values a stall's ``method`` label may take (else "other").
METHODS = frozenset({
    "key", "order", "outranks", "limits", "may_admit", "num_tokens", "choose_victim",
    "on_arrival", "on_step_end", "on_finish",  # the four policies
    "add", "abort", "schedule", "snapshot",  # a whole scheduler
    "step", "add_request",  # the engine's own (no plugin frame found)
})  # fmt: skip
MAX_POLL_S = 0.25


@dataclass(frozen=True)
class Stall:
    """The engine has been inside one call for longer than the bound."""

    plugin: str  # as the log names it ("queue policy 'slow' (path /srv/slow.py)"), or ENGINE
    method: str  # the method the engine called on it, or the engine's own call ("step")
    request_id: str | None  # the request that call concerned, when one did
    since: float  # time.monotonic() when the engine call began
    bound_s: float

    @property
    def where(self) -> str:
        """``queue policy 'slow'.key()``: what a client is told (no path)."""
        if self.plugin == ENGINE:
            return f"{ENGINE}'s {self.method}()"
        return f"{public_name(self.plugin)}.{self.method}()"

    @property
    def message(self) -> str:
        return f"stalled in {self.where}: running for more than the watchdog's {self.bound_s:g} s"

    @property
    def labels(self) -> tuple[str, str]:
        """(plugin, method) for a metric: values from a bounded set."""
        return public_name(self.plugin), self.method if self.method in METHODS else "other"


class Watchdog:
    """Watches one thread's calls into the engine (``busy`` ... ``idle``); ``bound_s`` None: never reports."""

    def __init__(
        self,
        scheduler: Any,
        bound_s: float | None,
        lock: threading.Lock,
        on_stall: Callable[[Stall], None],
        on_resume: Callable[[Stall], None],
    ) -> None:
        self.bound_s = bound_s
        self.lock = lock  # held while a stall is declared, and when the engine thread leaves the engine
        self.on_stall, self.on_resume = on_stall, on_resume  # on_stall runs with the lock held
        self.door = getattr(scheduler, "door", None)
        self.gate = self.door if self.door is not None else scheduler  # what calls the plugins
        self.names: Mapping[int, str] = scheduler_names(scheduler)
        self.stall: Stall | None = None
        self._since: float | None = None
        self._what = ""
        self._watched: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self, watched: threading.Thread) -> None:
        self._watched = watched
        if self.bound_s is not None:
            threading.Thread(target=self._watch, name="cbcore-watchdog", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def busy(self, what: str) -> None:
        """The watched thread enters the engine (``what``: the engine's method it calls)."""
        self._what = what
        self._since = time.monotonic()

    def idle(self) -> None:
        """The watched thread has left the engine: a stall, if there was one, is over."""
        with self.lock:
            self._since = None
            stall, self.stall = self.stall, None
            if stall is not None and self.door is not None:
                self.door.overdue = None  # the flagged call may have returned without another call about its request
        if stall is not None:
            log.warning("the engine resumed after a stall", plugin=stall.plugin, method=stall.method,
                        request_id=stall.request_id, stalled_s=round(time.monotonic() - stall.since, 3))  # fmt: skip
            self.on_resume(stall)

    def _watch(self) -> None:
        assert self.bound_s is not None
        while not self._stop.wait(min(MAX_POLL_S, self.bound_s / 4)):
            try:
                self.check()
            except Exception:  # a watchdog that dies would leave every later stall silent
                log.exception("watchdog check failed")

    def check(self) -> Stall | None:
        """Declare a stall if the watched thread has been inside the engine past the bound; returns it."""
        with self.lock:
            since, thread = self._since, self._watched
            if since is None or self.stall is not None or thread is None or self.bound_s is None:
                return None
            running_s = time.monotonic() - since
            if running_s <= self.bound_s:
                return None
            frame = sys._current_frames().get(thread.ident or -1)
            plugin, method, seq = self.culprit(frame)
            stall = Stall(plugin or ENGINE, method or self._what, seq.request_id if seq else None, since, self.bound_s)
            self.stall = stall
            if seq is not None and self.door is not None:  # failed by the door when the call returns
                self.door.overdue = (seq, plugin, f"{method}() took longer than the watchdog's {self.bound_s:g} s")
            log.error("the engine stalled: the requests in flight end, /health answers 503 until the call returns",
                      plugin=stall.plugin, method=stall.method, request_id=stall.request_id,
                      running_s=round(running_s, 3), watchdog_s=self.bound_s,
                      stack="".join(traceback.format_stack(frame)) if frame is not None else None)  # fmt: skip
            self.on_stall(stall)
            return stall

    def culprit(self, frame: FrameType | None) -> tuple[str | None, str | None, Sequence | None]:
        """(plugin, method, the sequence the call is about) of the plugin call on a stack, innermost ``frame`` up.

        The call is the innermost one the door (or a whole scheduler's guard) made: a plugin's own helpers are
        beneath it, and a policy reading what the engine computes on demand (``state.waiting`` orders the queue)
        is above it. With no such frame (the door asking again in a lambda), the outermost plugin frame.
        """
        made = outermost = None
        while frame is not None:
            code = frame.f_code
            if code.co_argcount and code.co_varnames[0] == "self" and id(frame.f_locals.get("self")) in self.names:
                outermost = frame
                if made is None and frame.f_back is not None and frame.f_back.f_locals.get("self") is self.gate:
                    made = frame
            frame = frame.f_back
        called = made or outermost
        if called is None:
            return None, None, None
        plugin = self.names[id(called.f_locals["self"])]
        seq = called.f_back.f_locals.get("seq") if called is made and self.door is not None else None
        return plugin, called.f_code.co_name, seq if isinstance(seq, Sequence) else None
