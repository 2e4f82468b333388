"""cbcore's scheduling policies deciding inside vLLM's v1 scheduler.

Start vLLM with ``--scheduler-cls cbcore_vllm.Scheduler --no-async-scheduling
--additional-config '{"cbcore": {"scheduler": {...}}}'`` (docs/vllm.md).
"""

from cbcore_vllm.scheduler import Scheduler

__all__ = ["Scheduler"]
