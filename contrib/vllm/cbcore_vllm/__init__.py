"""cbcore's scheduling policies deciding inside vLLM's v1 scheduler.

Start vLLM with ``--scheduler-cls cbcore_vllm.Scheduler --additional-config
'{"cbcore": {"scheduler": {...}}}'`` and, in front of its API, ``--middleware
cbcore_vllm.RequestCheck`` (docs/vllm.md). The names resolve on first use, so
that importing this package does not import vLLM's scheduler (the
scheduler-level harness must set vLLM's platform first).
"""

from __future__ import annotations

from typing import Any

__all__ = ["RequestCheck", "Scheduler"]


def __getattr__(name: str) -> Any:
    if name == "Scheduler":
        from cbcore_vllm.scheduler import Scheduler

        return Scheduler
    if name == "RequestCheck":
        from cbcore_vllm.middleware import RequestCheck

        return RequestCheck
    raise AttributeError(f"module 'cbcore_vllm' has no attribute {name!r}")
