"""Refusing one request (bad ``vllm_xargs``, a policy raising in ``on_arrival``) without stopping vLLM.

cbcore's engine refuses such a request alone and serves the others. vLLM's
scheduler has one path that ends a request with an error and still reports it
to its client: the ids it collects during a step (``grammar_compile_error_reqs``)
and finishes with ``FINISHED_ERROR`` in ``update_from_output``. A refused
request is registered with vLLM (so it can be finished) but never queued, and
is handed to that path at the next step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import structlog
from vllm.v1.request import Request

if TYPE_CHECKING:
    from cbcore_vllm.scheduler import Scheduler

log = structlog.get_logger(__name__)


class Refusals:
    def __init__(self) -> None:
        self._ids: set[str] = set()

    @property
    def pending(self) -> int:
        return len(self._ids)

    def refuse(self, scheduler: Scheduler, request: Request, message: str) -> None:
        log.error("request refused", request_id=request.request_id, error=message)
        scheduler.requests[request.request_id] = request
        self._ids.add(request.request_id)

    def hand_to(self, scheduler: Scheduler) -> None:
        """Let this step's update_from_output finish them with an error."""
        scheduler.grammar_compile_error_reqs.update(self._ids)
        self._ids.clear()
