"""cbcore: continuous-batching LLM inference with pluggable policies and backends.

The public names are imported lazily: ``import cbcore.policies`` (what a
plugin or ``cb plugins`` needs) must not pay for importing transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "Backend": "cbcore.backend",
    "BackendUnavailable": "cbcore.backend",
    "BudgetPolicy": "cbcore.policy",
    "Engine": "cbcore.engine",
    "EngineConfig": "cbcore.config",
    "FinishReason": "cbcore.sequence",
    "FlatBatch": "cbcore.batch",
    "PreemptionPolicy": "cbcore.policy",
    "PrefillPolicy": "cbcore.policy",
    "QueuePolicy": "cbcore.policy",
    "RequestError": "cbcore.engine",
    "RequestMetrics": "cbcore.outputs",
    "RequestOutput": "cbcore.outputs",
    "SamplingParams": "cbcore.sampling_params",
    "Scheduler": "cbcore.scheduler",
    "SchedulerOutput": "cbcore.scheduler",
    "Sequence": "cbcore.sequence",
    "StepRecord": "cbcore.engine",
    "hookimpl": "cbcore.plugins",
}

__all__ = [
    "Backend",
    "BackendUnavailable",
    "BudgetPolicy",
    "Engine",
    "EngineConfig",
    "FinishReason",
    "FlatBatch",
    "PreemptionPolicy",
    "PrefillPolicy",
    "QueuePolicy",
    "RequestError",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "Scheduler",
    "SchedulerOutput",
    "Sequence",
    "StepRecord",
    "__version__",
    "hookimpl",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'cbcore' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__


if TYPE_CHECKING:
    from cbcore.backend import Backend, BackendUnavailable
    from cbcore.batch import FlatBatch
    from cbcore.config import EngineConfig
    from cbcore.engine import Engine, RequestError, StepRecord
    from cbcore.outputs import RequestMetrics, RequestOutput
    from cbcore.plugins import hookimpl
    from cbcore.policy import BudgetPolicy, PreemptionPolicy, PrefillPolicy, QueuePolicy
    from cbcore.sampling_params import SamplingParams
    from cbcore.scheduler import Scheduler, SchedulerOutput
    from cbcore.sequence import FinishReason, Sequence
