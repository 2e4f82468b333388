"""Refusing one request (bad ``vllm_xargs``, a policy raising in ``on_arrival``) without stopping vLLM.

cbcore's engine refuses such a request alone and serves the others. vLLM's
scheduler has one path that ends a request with an error and still reports it
to its client: the per-request error path of ``update_from_output``, which
the version's shim section fills (``finish_with_error``). A refused request
is registered with vLLM (so it can be finished) but never queued, and is
handed to that path at the next ``update_from_output``. From vLLM 0.33.0 on
the reason reaches the client (a bad field as HTTP 400 naming it); on 0.32.0
only ``finish_reason: "error"`` does, so the adapter's API middleware
(``middleware.py``) refuses a bad field before it reaches the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import structlog
from vllm.v1.request import Request

if TYPE_CHECKING:
    from cbcore_vllm.scheduler import Scheduler
    from cbcore_vllm.shim import V0_32

log = structlog.get_logger(__name__)


class Refusals:
    def __init__(self, internals: V0_32) -> None:
        self._vllm = internals
        self._pending: dict[str, tuple[str, str]] = {}  # request id -> (error code, message)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def refuse(self, scheduler: Scheduler, request: Request, code: str, message: str) -> None:
        """``code``: vLLM's error code (``validation_error`` reaches an API client as HTTP 400)."""
        log.error("request refused", request_id=request.request_id, error=message)
        scheduler.requests[request.request_id] = request
        self._pending[request.request_id] = (code, message)

    def hand_to(self, scheduler: Scheduler) -> None:
        """Let this update_from_output finish them with an error."""
        for request_id, (code, message) in self._pending.items():
            self._vllm.finish_with_error(scheduler, request_id, code, message)
        self._pending.clear()
