"""The engine on its own thread: HTTP handlers talk to it through an inbox and async queues.

Only this thread touches the engine. Handlers put submissions and aborts on a
thread-safe inbox; the thread takes them in between steps, steps while there
is work and sleeps on an event when there is none, and after every step hands
each request its delta through the request's ``asyncio.Queue`` — one
``call_soon_threadsafe`` per step for all of them, so the event loop is woken
once per step, never blocked by one.

The thread never dies silently and never hangs its clients. A plugin failure
about one request the engine ends itself (that request's output says which
plugin and method). Whatever else comes out of the engine (a failure about no
single request, one that recurred when the step was planned again, a
``MemoryError``, any ``BaseException``) stops the engine for good: every request
in flight ends with an error naming the cause, ``trouble`` says why (``/health``
answers 503 with it, new requests get 503), and the log has the whole
exception. A call that runs past ``serve.watchdog_s`` is a stall
(:mod:`cbcore.serve.watchdog`): the requests in flight end with an error naming
the plugin and method, new ones get 503, until the call returns. A client is
told only what :mod:`cbcore.serve.failures` builds: never another request's id
or a path on the server.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from cbcore.engine import Engine, RequestError
from cbcore.kernels.placement import pin_openmp_team
from cbcore.log import get_logger
from cbcore.outputs import RequestOutput
from cbcore.scale.router import EngineLoad, engine_load
from cbcore.scheduling.door import PolicyError
from cbcore.scheduling.scheduler import SchedulerError
from cbcore.serve.channel import Accepted, Event, Failed, Handle, Observer, Submission
from cbcore.serve.failures import public_reason, scheduler_names
from cbcore.serve.watchdog import Stall, Watchdog

log = get_logger(__name__)


def release_openmp_workers() -> str | None:
    """Let the calling thread's OpenMP workers go, before another thread steps the engine; None, else why not.

    libgomp keeps a pool of workers for every thread that ran a parallel
    region, and once its pools hold more threads than there are cores it stops
    spinning between regions: every region then waits on a futex. A server
    builds the engine on one thread and steps it on another, so both pools
    live: one decode step of the default model took 54-61 ms on the engine
    thread against 36-38 on the thread that built it (2-core host), and 39-45
    once the builder's pool was released. Its next parallel region, if any,
    starts a new pool.
    """
    try:
        # torch's own, if it runs libgomp; not loading one of our own
        loaded = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        pause = loaded.omp_pause_resource_all
    except (OSError, AttributeError) as exc:
        return f"torch runs no libgomp with omp_pause_resource_all ({exc})"
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    if pause(1) != 0:  # omp_pause_soft
        return "omp_pause_resource_all refused (inside a parallel region?)"
    return None


StallListener = Callable[[Stall, bool], None]  # (the stall, True when it begins / False when it ends)


class EngineLoop:
    def __init__(
        self,
        engine: Engine,
        observers: list[Observer] | None = None,
        abort_listeners: list[Callable[[str], None]] | None = None,
        stall_listeners: list[StallListener] | None = None,
        watchdog_s: float | None = None,
    ) -> None:
        self.engine = engine
        self.observers = observers or []  # called on this thread after every step (metrics)
        self.abort_listeners = abort_listeners or []  # called with the reason of each abort that took effect
        self.stall_listeners = stall_listeners or []  # called when a stall begins and when it ends
        self._inbox: deque[tuple[str, Any]] = deque()
        self._wake = threading.Event()
        self._lock = threading.Lock()  # the inbox's appends, _queued, and the watchdog's view of the engine thread
        self._queued = 0  # submitted, not yet taken by the engine thread
        # The engine thread's, and the watchdog's while it declares a stall (the engine thread is then in the engine).
        self._handles: dict[str, Handle] = {}
        self._adding: tuple[str, Handle] | None = None  # the submission in add_request now
        self.failure: str | None = None  # why the engine stopped for good (what a client may be told)
        self.watchdog = Watchdog(engine.scheduler, watchdog_s, self._lock, self._on_stall, self._on_resume)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._deadline: float | None = None  # past this, draining aborts what is left
        self.draining = False
        self.load: EngineLoad = engine_load(engine)

    # -- event-loop side ---------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Step the engine on a thread of its own; call on the thread that built the engine."""
        self._loop = loop
        why_kept = release_openmp_workers()  # else two OpenMP pools share the cores and stop spinning
        log.info(
            "engine thread",
            builder_openmp_workers="released" if why_kept is None else "kept",
            why_kept=why_kept,
        )
        placed = threading.Event()  # the engine thread's team placed: it then serves as before placement existed
        self._thread = threading.Thread(target=self._run, args=(placed,), name="cbcore-engine", daemon=True)
        self._thread.start()
        placed.wait()
        self.watchdog.start(self._thread)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def refusal(self) -> str | None:
        """Why the engine takes no new work now (it stopped, or it is stalled); None when it takes it."""
        if self.failure is not None:
            return f"the engine stopped: {self.failure}"
        stall = self.watchdog.stall
        return None if stall is None else stall.message

    @property
    def trouble(self) -> str | None:
        """What /health says is wrong: a refusal, or the engine thread not running; None when nothing is."""
        if (why := self.refusal) is not None:
            return why
        if not self.alive:
            return "the engine thread has stopped" if self._thread is not None else "the engine thread has not started"
        return None

    @property
    def num_waiting(self) -> int:
        """Requests not yet running: in the inbox, or waiting in the engine after the last step."""
        return self._queued + self.load.num_waiting

    def submit(self, sub: Submission) -> Handle:
        handle = Handle(sub.request_id)
        with self._lock:  # a stall declared meanwhile refuses what the inbox holds: this one is refused here
            if (refused := self.refusal) is None:
                self._queued += 1
                self._inbox.append(("add", (sub, handle)))
        if refused is not None:
            handle.queue.put_nowait(Failed(refused, 503))
        self._wake.set()
        return handle

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """Cancel a request (client gone: "abort"; stop string seen: "stop"); takes effect before the next step.

        A request that finished meanwhile is left alone (and not counted twice).
        """
        with self._lock:
            self._inbox.append(("abort", (request_id, reason)))
        self._wake.set()

    async def reset_prefix_cache(self) -> int:
        """Forget every cached prefix no request holds, between two steps; returns how many blocks were freed."""
        assert self._loop is not None and self.alive, "the engine thread is not running"
        freed: asyncio.Future[int] = self._loop.create_future()
        with self._lock:
            self._inbox.append(("reset", freed))
        self._wake.set()
        return await freed

    def begin_drain(self, grace_s: float) -> None:
        """Shutdown has begun: refuse new requests, abort what has not finished after ``grace_s``."""
        self.draining = True
        self._deadline = time.monotonic() + grace_s
        self._wake.set()
        log.info("draining", in_flight=len(self._handles), grace_s=grace_s)

    def stop(self, timeout: float = 10.0) -> None:
        """Abort everything still running and end the thread (not waiting for it while it is stalled)."""
        self._stopping = True
        self._wake.set()
        self.watchdog.stop()
        if self._thread is not None:
            self._thread.join(0 if self.watchdog.stall is not None else timeout)

    # -- engine thread -------------------------------------------------------------

    def _run(self, placed: threading.Event) -> None:
        try:
            try:
                why = pin_openmp_team()  # this thread's team runs every step
            finally:
                placed.set()
            log.info("engine threads", placed="one to a core" if why is None else "as the system places them", why=why)
            self._serve()
        except BaseException as exc:  # a fault of this loop's own: said, and every client told, as the thread ends
            self._stop_engine(exc)

    def _serve(self) -> None:
        while not self._stopping:
            self._wake.clear()
            self._take_inbox()
            if self._deadline is not None and time.monotonic() >= self._deadline:
                self._fail_all("the server is shutting down", 503)
            try:
                work = self.failure is None and self.engine.has_unfinished()
                outputs = self._call("step", self.engine.step) if work else None
            except BaseException as exc:  # whatever it is, the thread lives on to say so
                self._stop_engine(exc)
                continue
            if outputs is None:
                self._publish([])
                timeout = None if self._deadline is None else max(0.0, self._deadline - time.monotonic())
                self._wake.wait(timeout if self._handles else None)
                continue
            self._deliver(outputs)
            self._publish(outputs)
        self._take_inbox()
        self._fail_all("the server is shutting down", 503)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        load = engine_load(self.engine)
        if not outputs and load == self.load:
            return
        self.load = load
        for observe in self.observers:
            try:
                observe(outputs, load)
            except Exception:  # a metrics bug must not stop serving
                log.exception("observer failed")

    def _take_inbox(self) -> None:
        while self._inbox:
            kind, item = self._inbox.popleft()
            if kind == "reset":
                self._answer(item, self.engine.reset_prefix_cache)
                continue
            if kind in ("abort", "drop"):  # drop: a request the watchdog ended (its handle is gone)
                request_id, reason = item
                if kind == "drop" or self._handles.pop(request_id, None) is not None:
                    self._abort(request_id, reason)
                continue
            sub, handle = item
            with self._lock:
                self._queued -= 1
            if (event := self._add(sub, handle)) is not None:
                self._post([(handle, event)])

    def _call(self, what: str, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call into the engine under the watchdog's eye."""
        self.watchdog.busy(what)
        try:
            return call(*args, **kwargs)
        finally:
            self.watchdog.idle()

    def _abort(self, request_id: str, reason: str) -> None:
        if self.failure is not None:
            return  # nothing runs any more; what was in flight has been aborted
        try:
            aborted = self._call("abort", self.engine.abort, request_id)
        except BaseException as exc:  # only a whole-scheduler plugin can fail here; its books are in doubt
            self._stop_engine(exc)
            return
        if aborted:
            for listener in self.abort_listeners:
                listener(reason)

    def _add(self, sub: Submission, handle: Handle) -> Event | None:
        """Queue ``sub`` in the engine; its first event (None: the watchdog has answered it meanwhile)."""
        if self.draining or self._stopping:
            return Failed("the server is shutting down", 503)
        if (why := self.refusal) is not None:
            return Failed(why, 503)
        self._adding = (sub.request_id, handle)
        event: Event = Accepted()
        try:
            self._call("add_request", self.engine.add_request, sub.prompt_token_ids, sub.params,
                       request_id=sub.request_id, arrival_time=sub.arrival_time, **dict(sub.fields))  # fmt: skip
        except RequestError as exc:
            event = Failed(str(exc), 400)
        except BaseException as exc:
            event = self._refused(sub.request_id, exc)
        answered, self._adding = self._adding is None, None  # read after idle(): no stall is declared now
        if answered:
            return None
        if isinstance(event, Accepted):
            self._handles[sub.request_id] = handle
        return event

    def _refused(self, request_id: str, exc: BaseException) -> Failed:
        """add_request raised: a plugin's failure on this arrival fails it alone; one about no single request stops."""
        if isinstance(exc, PolicyError) and exc.request_id == request_id:
            log.error("request refused: a plugin failed on its arrival", request_id=request_id, plugin=exc.plugin,
                      rule=exc.rule, error=str(exc), exc_info=exc)  # fmt: skip
            return Failed(exc.public, 500)
        if isinstance(exc, Exception) and not isinstance(exc, SchedulerError | MemoryError):
            log.error("add_request failed", request_id=request_id, exc_info=exc)  # all or nothing: nothing was added
            return Failed(f"the request could not be queued: {type(exc).__name__}", 500)
        self._stop_engine(exc)
        return Failed(f"the engine stopped: {self.failure}", 503)

    def _stop_engine(self, exc: BaseException) -> None:
        """Something no single request explains came out of the engine: end what is in flight, refuse the rest."""
        self.failure = public_reason(exc, scheduler_names(self.engine.scheduler))
        log.error("the engine stopped: the requests in flight end, new ones get 503 until the server is restarted",
                  reason=self.failure, error=f"{type(exc).__name__}: {exc}", exc_info=exc)  # fmt: skip
        self._fail_all(f"the engine stopped: {self.failure}", 500)
        self._publish([])

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        batch = []
        for out in outputs:
            handle = self._handles.get(out.request_id)
            if handle is None:  # aborted while its last step ran
                continue
            if out.finished:
                del self._handles[out.request_id]
            batch.append((handle, out))
        self._post(batch)

    def _fail_all(self, message: str, status: int) -> None:
        batch = []
        for request_id, handle in list(self._handles.items()):
            try:
                self.engine.abort(request_id)
            except BaseException:  # the engine may be in a bad state after a failed step
                log.exception("abort failed", request_id=request_id)
            batch.append((handle, Failed(message, status)))
        self._handles.clear()
        self._post(batch)

    # -- the watchdog (its thread) ------------------------------------------------------

    def _on_stall(self, stall: Stall) -> None:
        """A stall begins (the lock held; the engine thread is in the engine): the requests in flight end now, and
        what waits in the inbox is refused; those already in the engine are aborted once its thread is back."""
        failed = Failed(stall.message, 503)
        batch = [(handle, failed) for handle in self._handles.values()]
        drops = [("drop", (request_id, "error")) for request_id in self._handles]
        self._handles = {}
        if self._adding is not None:
            request_id, handle = self._adding
            batch.append((handle, failed))
            drops.append(("drop", (request_id, "error")))
            self._adding = None
        kept = []
        for kind, item in self._inbox:
            if kind == "add":
                batch.append((item[1], failed))
                self._queued -= 1
            else:
                kept.append((kind, item))
        self._inbox.clear()
        self._inbox.extend([*drops, *kept])
        self._post(batch)
        self._tell_stall(stall, True)

    def _on_resume(self, stall: Stall) -> None:
        self._tell_stall(stall, False)

    def _tell_stall(self, stall: Stall, begins: bool) -> None:
        for listener in self.stall_listeners:
            try:
                listener(stall, begins)
            except Exception:  # a metrics bug must not stop serving
                log.exception("stall listener failed")

    def _answer(self, future: asyncio.Future[Any], call: Callable[[], Any]) -> None:
        """Run ``call`` here and settle ``future`` on the event loop with its result or its exception."""
        try:
            result, settle = call(), future.set_result
        except Exception as exc:
            result, settle = exc, future.set_exception
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(lambda: future.done() or settle(result))

    def _post(self, batch: list[tuple[Handle, Event]]) -> None:
        if batch and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(_put_all, batch)


def _put_all(batch: list[tuple[Handle, Event]]) -> None:
    for handle, event in batch:
        handle.queue.put_nowait(event)
