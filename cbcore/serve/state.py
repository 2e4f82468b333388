"""What every handler of one server shares: the engine loop, the tokenizer, the limits and the settings.

Kept apart from :mod:`cbcore.serve.app` (which builds the application) so
that the routes can name it without importing the app that includes them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from cbcore.serve.config import ServeConfig
from cbcore.serve.convert import Limits
from cbcore.serve.engine_loop import EngineLoop
from cbcore.serve.errors import ApiError
from cbcore.serve.guard import default_body_limit
from cbcore.serve.metrics import ServerMetrics
from cbcore.serve.prompts import PromptBuilder


@dataclass
class ServerState:
    loop: EngineLoop
    tokenizer: Any
    model_name: str
    limits: Limits
    settings: ServeConfig
    metrics: ServerMetrics
    api_key: str | None = None
    started: int = field(default_factory=lambda: int(time.time()))
    prompts: PromptBuilder = field(init=False)

    def __post_init__(self) -> None:
        self.prompts = PromptBuilder(self.tokenizer, self.limits, self.settings.tokenizer_threads)

    @property
    def max_body_bytes(self) -> int:
        if self.settings.max_body_bytes is not None:
            return self.settings.max_body_bytes
        return default_body_limit(self.prompts.context)

    def admit(self) -> None:
        """503 (with Retry-After) while shutting down, while the engine cannot take work (stopped, stalled:
        the reason), or while the waiting queue is full."""
        retry = {"Retry-After": str(self.settings.retry_after_s)}
        if self.loop.draining:
            raise ApiError(503, "the server is shutting down", headers=retry)
        if (trouble := self.loop.trouble) is not None:
            raise ApiError(503, trouble, headers=retry)
        limit = self.settings.max_waiting
        if limit is not None and self.loop.num_waiting >= limit:
            raise ApiError(503, f"the server is full: {limit} requests are already waiting", headers=retry)
