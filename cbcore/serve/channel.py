"""What a handler and the engine thread exchange: a submission in, a request's events out on its queue."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from cbcore.outputs import RequestOutput
from cbcore.scale.router import EngineLoad
from cbcore.scheduling.request import RequestFields
from cbcore.scheduling.sampling_params import SamplingParams


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
