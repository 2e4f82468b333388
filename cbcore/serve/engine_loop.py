"""The engine on its own thread: HTTP handlers talk to it through an inbox and async queues.

Only this thread touches the engine. Handlers put submissions and aborts on a
thread-safe inbox; the thread takes them in between steps, steps while there
is work and sleeps on an event when there is none, and after every step hands
each request its delta through the request's ``asyncio.Queue`` — one
``call_soon_threadsafe`` per step for all of them, so the event loop is woken
once per step, never blocked by one.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cbcore.engine import Engine, RequestError
from cbcore.log import get_logger
from cbcore.outputs import RequestOutput
from cbcore.scale.router import EngineLoad, engine_load
from cbcore.scheduling.request import RequestFields
from cbcore.scheduling.sampling_params import SamplingParams

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


@dataclass(frozen=True)
class Submission:
    """A request as the engine takes it: token ids, decoding and scheduling fields."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    fields: RequestFields = field(default_factory=RequestFields)
    arrival_time: float = field(default_factory=time.perf_counter)


@dataclass(frozen=True)
class Accepted:
    """The engine queued the request (the first event of every accepted request)."""


@dataclass(frozen=True)
class Failed:
    """The request ended without a normal finish; ``status`` is the HTTP status to report."""

    message: str
    status: int = 500


Event = Accepted | Failed | RequestOutput
Observer = Callable[[list[RequestOutput], EngineLoad], None]


class Handle:
    """A request's end of the channel: the queue its events arrive on."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.queue: asyncio.Queue[Event] = asyncio.Queue()

    async def next(self) -> Event:
        return await self.queue.get()


class EngineLoop:
    def __init__(
        self,
        engine: Engine,
        observers: list[Observer] | None = None,
        abort_listeners: list[Callable[[str], None]] | None = None,
    ) -> None:
        self.engine = engine
        self.observers = observers or []  # called on this thread after every step (metrics)
        self.abort_listeners = abort_listeners or []  # called with the reason of each abort that took effect
        self._inbox: deque[tuple[str, Any]] = deque()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._queued = 0  # submitted, not yet taken by the engine thread
        self._handles: dict[str, Handle] = {}  # engine thread only
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
        self._thread = threading.Thread(target=self._run, name="cbcore-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_waiting(self) -> int:
        """Requests not yet running: in the inbox, or waiting in the engine after the last step."""
        return self._queued + self.load.num_waiting

    def submit(self, sub: Submission) -> Handle:
        handle = Handle(sub.request_id)
        with self._lock:
            self._queued += 1
            self._inbox.append(("add", (sub, handle)))
        self._wake.set()
        return handle

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """Cancel a request (client gone: "abort"; stop string seen: "stop"); takes effect before the next step.

        A request that finished meanwhile is left alone (and not counted twice).
        """
        self._inbox.append(("abort", (request_id, reason)))
        self._wake.set()

    async def reset_prefix_cache(self) -> int:
        """Forget every cached prefix no request holds, between two steps; returns how many blocks were freed."""
        assert self._loop is not None and self.alive, "the engine thread is not running"
        freed: asyncio.Future[int] = self._loop.create_future()
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
        """Abort everything still running and end the thread."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    # -- engine thread -------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping:
            self._wake.clear()
            self._take_inbox()
            if self._deadline is not None and time.monotonic() >= self._deadline:
                self._fail_all("the server is shutting down", 503)
            if not self.engine.has_unfinished():
                self._publish([])
                timeout = None if self._deadline is None else max(0.0, self._deadline - time.monotonic())
                self._wake.wait(timeout if self._handles else None)
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:
                log.exception("engine step failed; failing the requests in flight")
                self._fail_all(f"engine error: {exc}", 500)
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
            if kind == "abort":
                request_id, reason = item
                if self._handles.pop(request_id, None) is not None:
                    self.engine.abort(request_id)
                    for listener in self.abort_listeners:
                        listener(reason)
                continue
            sub, handle = item
            with self._lock:
                self._queued -= 1
            self._post([(handle, self._add(sub, handle))])

    def _add(self, sub: Submission, handle: Handle) -> Event:
        if self.draining or self._stopping:
            return Failed("the server is shutting down", 503)
        try:
            self.engine.add_request(
                sub.prompt_token_ids,
                sub.params,
                request_id=sub.request_id,
                arrival_time=sub.arrival_time,
                **dict(sub.fields),
            )
        except RequestError as exc:
            return Failed(str(exc), 400)
        except Exception as exc:  # a plugin's on_arrival, say: the request fails, the server goes on
            log.exception("add_request failed", request_id=sub.request_id)
            return Failed(f"the request could not be queued: {exc}", 500)
        self._handles[sub.request_id] = handle
        return Accepted()

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
            except Exception:  # the engine may be in a bad state after a failed step
                log.exception("abort failed", request_id=request_id)
            batch.append((handle, Failed(message, status)))
        self._handles.clear()
        self._post(batch)

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
