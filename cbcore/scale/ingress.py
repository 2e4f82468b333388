"""The ingress: the single-process server's routes, with the engine loop replaced by the replicas.

:class:`RemoteLoop` offers the handlers what :class:`~cbcore.serve.engine_loop.EngineLoop`
offers them (``submit`` returning a :class:`~cbcore.serve.engine_loop.Handle`,
``abort``, ``num_waiting``, ``load``, draining), so the request models,
validation, detokenisation, streaming and metrics are the server's own code.
Each submission becomes one streaming call to a replica, placed by the
router. When the replica dies before the request has produced a token, the
call is made again (on another replica, as the dead one has left routing);
after a token, the stream ends with a clear error, as a stream cannot be
replayed without the client seeing text twice.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import deque
from collections.abc import Callable
from typing import Any

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle

from cbcore.log import get_logger
from cbcore.outputs import RequestOutput
from cbcore.scale.replica import Batch
from cbcore.scale.router import EngineLoad
from cbcore.serve.channel import Accepted, Failed, Handle, Observer, Submission
from cbcore.serve.errors import ApiError

log = get_logger(__name__)

#: What a dead or unreachable replica raises in a caller.
REPLICA_LOST = (ActorDiedError, ActorUnavailableError, RayActorError, DeploymentUnavailableError)


def total_load(loads: dict[str, EngineLoad]) -> EngineLoad:
    fields = [f.name for f in dataclasses.fields(EngineLoad)]
    return EngineLoad(**{f: sum(getattr(x, f) for x in loads.values()) for f in fields})


class RemoteLoop:
    """The engine-loop interface over a deployment of engine replicas."""

    def __init__(
        self,
        replicas: DeploymentHandle,
        *,
        max_attempts: int = 3,
        route_timeout_s: float = 60.0,
        prefix_caching: bool = True,
        observers: list[Observer] | None = None,
        abort_listeners: list[Callable[[str], None]] | None = None,
    ) -> None:
        self.replicas = replicas.options(stream=True, method_name="generate")
        self.max_attempts = max_attempts
        self.route_timeout_s = route_timeout_s
        self.prefix_caching = prefix_caching  # the replicas' kv_cache.prefix_caching
        self.observers = observers or []
        self.abort_listeners = abort_listeners or []  # called with the reason of each abort that took effect
        self.draining = False
        self.loads: dict[str, EngineLoad] = {}  # the last load each replica sent
        self.served_by: dict[str, str] = {}  # request id -> replica, while in flight
        self.placements: deque[tuple[str, str]] = deque(maxlen=4096)  # (request id, replica), newest last
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._no_token_yet: set[str] = set()

    # -- what the routes use ---------------------------------------------------

    @property
    def alive(self) -> bool:
        return True  # replicas are watched by Ray Serve; the ingress serves while it runs

    @property
    def trouble(self) -> str | None:
        return None  # a replica in trouble fails its health check, and Ray Serve replaces it

    @property
    def load(self) -> EngineLoad:
        return total_load(self.loads)

    @property
    def num_waiting(self) -> int:
        """Requests sent that have not produced a token yet (routing, queued in a replica, prefilling)."""
        return len(self._no_token_yet)

    def submit(self, sub: Submission) -> Handle:
        handle = Handle(sub.request_id)
        self._no_token_yet.add(sub.request_id)
        task = asyncio.ensure_future(self._pump(sub, handle))
        self._tasks[sub.request_id] = task
        task.add_done_callback(lambda _: self._forget(sub.request_id))
        return handle

    def abort(self, request_id: str, reason: str = "abort") -> None:
        task = self._tasks.get(request_id)
        if task is not None and not task.done():
            task.cancel()  # cancels the replica call, which aborts the request in its engine
            for listener in self.abort_listeners:
                listener(reason)

    async def reset_prefix_cache(self) -> int:
        """A deployment handle reaches one replica per call, so no call empties them all."""
        if not self.prefix_caching:
            return 0
        raise ApiError(
            501,
            "POST /reset_prefix_cache: a server with replicas cannot empty each replica's prefix cache "
            "(benchmark it with --set kv_cache.prefix_caching=false)",
        )

    def begin_drain(self, grace_s: float) -> None:
        self.draining = True

    def start(self, loop: asyncio.AbstractEventLoop) -> None: ...

    def stop(self, timeout: float = 10.0) -> None:
        for task in list(self._tasks.values()):
            task.cancel()

    # -- one request -----------------------------------------------------------------

    def _forget(self, request_id: str) -> None:
        self._tasks.pop(request_id, None)
        self._no_token_yet.discard(request_id)
        self.served_by.pop(request_id, None)

    async def _pump(self, sub: Submission, handle: Handle) -> None:
        accepted = streamed = False
        for attempt in range(1, self.max_attempts + 1):
            replica = "?"
            stream = self.replicas.remote(sub)
            try:
                it = stream.__aiter__()
                batch: Batch = await asyncio.wait_for(it.__anext__(), self.route_timeout_s)
                while True:
                    if replica != batch.replica_id:
                        replica = batch.replica_id
                        self.served_by[sub.request_id] = replica
                        self.placements.append((sub.request_id, replica))
                    self._note(batch)
                    for event in batch.events:
                        if isinstance(event, Accepted):
                            if accepted:
                                continue  # a retry: the handler already has its Accepted
                            accepted = True
                        elif isinstance(event, RequestOutput) and event.new_token_ids:
                            streamed = True
                            self._no_token_yet.discard(sub.request_id)
                        handle.queue.put_nowait(event)
                    batch = await it.__anext__()
            except StopAsyncIteration:
                return
            except TimeoutError:
                stream.cancel()
                handle.queue.put_nowait(
                    Failed(f"no replica took the request within {self.route_timeout_s:.0f} s", 503)
                )
                return
            except asyncio.CancelledError:
                stream.cancel()
                raise
            except REPLICA_LOST as exc:
                self.loads.pop(replica, None)
                if not streamed and attempt < self.max_attempts:
                    log.warning("replica lost before the first token; retrying", request_id=sub.request_id,
                                replica=replica, attempt=attempt, error=type(exc).__name__)
                    continue
                handle.queue.put_nowait(
                    Failed(
                        f"replica {replica} failed while serving this request "
                        f"({'after' if streamed else 'before'} its first token; attempt {attempt}): "
                        f"{type(exc).__name__}; send it again",
                        503,
                    )
                )
                return
            except BackPressureError as exc:
                handle.queue.put_nowait(Failed(f"every replica is full: {exc}", 503))
                return
            except Exception as exc:  # a router plugin's error, say: this request fails, the ingress goes on
                log.exception("request failed in the ingress", request_id=sub.request_id)
                handle.queue.put_nowait(Failed(f"{type(exc).__name__}: {exc}", 500))
                return

    def _note(self, batch: Batch) -> None:
        self.loads[batch.replica_id] = batch.load
        outputs = [e for e in batch.events if isinstance(e, RequestOutput)]
        if not self.observers:
            return
        load = self.load
        for observe in self.observers:
            try:
                observe(outputs, load)
            except Exception:  # a metrics bug must not stop serving
                log.exception("observer failed")


class Ingress:
    """The ingress deployment: the server's FastAPI app over a :class:`RemoteLoop`."""

    async def __init__(
        self,
        replicas: DeploymentHandle,
        config: dict[str, Any],
        model_name: str,
        api_key: str | None = None,
        max_attempts: int = 3,
        route_timeout_s: float = 60.0,
    ) -> None:
        from cbcore.scale.listeners import bind_replica_grpc_to_node_ip
        from cbcore.serve.app import ServerState
        from cbcore.serve.config import Settings
        from cbcore.serve.metrics import ServerMetrics, policy_label

        bind_replica_grpc_to_node_ip()  # before Serve starts this replica's gRPC server on [::]
        cfg = Settings.model_validate(config)
        # Limits and tokenizer come from a replica, so the ingress loads no model of its own.
        limits = await replicas.limits.remote()
        tokenizer = await replicas.get_tokenizer.remote()
        metrics = ServerMetrics(model_name, policy_label(cfg))
        self.loop = RemoteLoop(
            replicas,
            max_attempts=max_attempts,
            route_timeout_s=route_timeout_s,
            prefix_caching=cfg.kv_cache.prefix_caching,
            observers=[metrics.observe],
            abort_listeners=[metrics.finished],
        )
        self.state = ServerState(self.loop, tokenizer, model_name, limits, cfg.serve, metrics, api_key)  # type: ignore[arg-type]

    def placements(self) -> list[tuple[str, str]]:
        """Where recent requests went (request id, replica id), oldest first: routing made visible."""
        return list(self.loop.placements)

    def __serve_build_asgi_app__(self) -> Any:
        from cbcore.serve.app import make_app

        return make_app(self.state)
