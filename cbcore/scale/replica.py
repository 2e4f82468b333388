"""One engine replica: the server's engine loop inside a Ray Serve deployment.

Each replica builds its own engine (model, KV cache, policy mix) from the
config it is given and runs the same :class:`~cbcore.serve.engine_loop.EngineLoop`
as ``cb serve``; the ingress reaches it through a streaming
``DeploymentHandle`` call to :meth:`EngineReplica.generate`. It reports its
load for routing through Ray Serve's ``record_routing_stats`` hook and its
health through ``check_health``; when either shows it dead, Ray Serve takes
it out of routing and starts a new one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from cbcore.log import get_logger
from cbcore.outputs import RequestOutput
from cbcore.scale.router import EngineLoad
from cbcore.serve.channel import Event, Failed, Submission
from cbcore.serve.config import Settings
from cbcore.serve.engine_loop import EngineLoop

log = get_logger(__name__)


@dataclasses.dataclass(frozen=True)
class Batch:
    """What one replica sends per wake-up: the events ready for a request, and the replica's load."""

    replica_id: str
    events: list[Event]
    load: EngineLoad


def is_last(event: Event) -> bool:
    return isinstance(event, Failed) or (isinstance(event, RequestOutput) and event.finished)


class EngineReplica:
    """The deployment class (options are set in :mod:`cbcore.scale.app`)."""

    async def __init__(self, config: dict[str, Any], threads: int | None = None) -> None:
        from ray import serve

        from cbcore.engine import Engine
        from cbcore.kernels.heap import hold_freed_memory
        from cbcore.models.loading import load_model_and_tokenizer
        from cbcore.scale.listeners import bind_replica_grpc_to_node_ip

        bind_replica_grpc_to_node_ip()  # before Serve starts this replica's gRPC server on [::]
        hold_freed_memory()  # a replica is its own process: the application's allocator setting
        if threads is not None:
            import torch

            torch.set_num_threads(threads)
        self.config = Settings.model_validate(config)
        model, self.tokenizer = load_model_and_tokenizer(self.config.model.path, self.config.model)
        self.engine = Engine(model, None, self.config)  # token ids in and out: the ingress decodes
        self.loop = EngineLoop(self.engine, watchdog_s=self.config.serve.watchdog_s)
        self.loop.start(asyncio.get_running_loop())  # the loop generate() runs on
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        log.info("replica ready", replica=self.replica_id)

    async def generate(self, sub: Submission) -> AsyncIterator[Batch]:
        """Stream one request's events; abort it in the engine if the caller goes away first."""
        # perf_counter is per host: stamp arrival on this replica's clock so latencies and FCFS hold.
        handle = self.loop.submit(dataclasses.replace(sub, arrival_time=time.perf_counter()))
        done = False
        try:
            while not done:
                events = [await handle.next()]
                while not handle.queue.empty():
                    events.append(handle.queue.get_nowait())
                done = any(is_last(e) for e in events)
                yield Batch(self.replica_id, events, self.loop.load)
        finally:
            if not done:
                self.loop.abort(sub.request_id)

    def limits(self) -> Any:
        from cbcore.serve.convert import Limits

        return Limits.of(self.engine)

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def record_routing_stats(self) -> dict[str, Any]:
        """Polled by Ray Serve every ``load_interval_s``; routers read it as ``ReplicaView.load``."""
        return {"load": dataclasses.asdict(self.loop.load), "time": time.time()}

    def check_health(self) -> None:
        if (trouble := self.loop.trouble) is not None:  # stopped after a failure, stalled, or no engine thread
            raise RuntimeError(f"replica {self.replica_id}: {trouble}")

    def __del__(self) -> None:
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.stop(timeout=5.0)
