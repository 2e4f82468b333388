"""What the tests share, imported as ``support`` (``from support import PROMPTS``).

``tests/conftest.py`` keeps only fixtures and pytest hooks; everything a test
module imports lives here, in this package: the shared prompts and caps, the
server's test key, and the helper modules beside this file (the engine's
state as plain data, hand-built attention batches, the misbehaving plugins,
loopback HTTP clients, scripts run in fresh processes). The driver that runs
the scheduler without a model is public: :class:`cbcore.testing.FakeRun`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cbcore.testing import random_prompts

# 16 prompts of 1-64 tokens; caps cover 1 and 96 and much in between.
PROMPTS = random_prompts(16, 1, 64, seed=0)
CAPS = [1, 96, 17, 64, 5, 80, 33, 2, 48, 90, 12, 70, 25, 96, 8, 40]
PRIORITIES = [i % 3 for i in range(16)]
CLIENTS = ["alice" if i % 3 else "bob" for i in range(16)]

# The HTTP server of tests/test_serve_*.py (the ``tiny_server`` fixture).
SERVE_KEY = "test-key"
# Room for the load test's 200 concurrent requests; 64 running at once.
SERVE_ARGS = ["--threads", "1", "--set", "kv_cache.num_blocks=1024", "--set", "scheduler.budget.max_num_seqs=64"]


class LazyDict(dict):
    """Builds a value on first access to its key."""

    def __init__(self, make: Callable[[str], Any]) -> None:
        super().__init__()
        self.make = make

    def __missing__(self, key: str) -> Any:
        value = self[key] = self.make(key)
        return value
