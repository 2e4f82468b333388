"""cbcore: continuous-batching LLM inference with pluggable policies and backends.

The public names are imported lazily: ``import cbcore.policies`` (what a
plugin or ``cb plugins`` needs) must not pay for importing transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "Backend": "cbcore.execution.backend",
    "BackendUnavailable": "cbcore.execution.backend",
    "BudgetPolicy": "cbcore.scheduling.policy",
    "Engine": "cbcore.engine",
    "EngineConfig": "cbcore.config",
    "EngineLoad": "cbcore.stats",
    "FinishReason": "cbcore.scheduling.sequence",
    "FlatBatch": "cbcore.execution.batch",
    "KVView": "cbcore.scheduling.policy",
    "NoParams": "cbcore.plugins",
    "PluginError": "cbcore.plugins",
    "PreemptionPolicy": "cbcore.scheduling.policy",
    "PrefillPolicy": "cbcore.scheduling.policy",
    "QueuePolicy": "cbcore.scheduling.policy",
    "RequestError": "cbcore.engine",
    "RequestMetrics": "cbcore.outputs",
    "RequestOutput": "cbcore.outputs",
    "ReplicaView": "cbcore.scheduling.router",
    "RouteRequest": "cbcore.scheduling.router",
    "Router": "cbcore.scheduling.router",
    "RouterError": "cbcore.scheduling.router",
    "SamplingParams": "cbcore.scheduling.sampling_params",
    "Scheduler": "cbcore.scheduling.scheduler",
    "SchedulerOutput": "cbcore.scheduling.scheduler",
    "SchedulerError": "cbcore.scheduling.scheduler",
    "SchedulerPlugin": "cbcore.scheduling.scheduler",
    "SchedulerStall": "cbcore.scheduling.scheduler",
    "SchedulerState": "cbcore.scheduling.policy",
    "Sequence": "cbcore.scheduling.sequence",
    "SequenceView": "cbcore.scheduling.policy",
    "StepLimits": "cbcore.scheduling.policy",
    "StepPlan": "cbcore.scheduling.plan",
    "StepRecord": "cbcore.engine",
    "StepResult": "cbcore.scheduling.policy",
    "hookimpl": "cbcore.plugins",
}

__all__ = [
    "Backend",
    "BackendUnavailable",
    "BudgetPolicy",
    "Engine",
    "EngineConfig",
    "EngineLoad",
    "FinishReason",
    "FlatBatch",
    "KVView",
    "NoParams",
    "PluginError",
    "PreemptionPolicy",
    "PrefillPolicy",
    "QueuePolicy",
    "ReplicaView",
    "RequestError",
    "RequestMetrics",
    "RequestOutput",
    "RouteRequest",
    "Router",
    "RouterError",
    "SamplingParams",
    "Scheduler",
    "SchedulerError",
    "SchedulerOutput",
    "SchedulerPlugin",
    "SchedulerStall",
    "SchedulerState",
    "Sequence",
    "SequenceView",
    "StepLimits",
    "StepPlan",
    "StepRecord",
    "StepResult",
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
    from cbcore.config import EngineConfig
    from cbcore.engine import Engine, RequestError, StepRecord
    from cbcore.execution.backend import Backend, BackendUnavailable
    from cbcore.execution.batch import FlatBatch
    from cbcore.outputs import RequestMetrics, RequestOutput
    from cbcore.plugins import NoParams, PluginError, hookimpl
    from cbcore.scheduling.plan import StepPlan
    from cbcore.scheduling.policy import (
        BudgetPolicy,
        KVView,
        PreemptionPolicy,
        PrefillPolicy,
        QueuePolicy,
        SchedulerState,
        SequenceView,
        StepLimits,
        StepResult,
    )
    from cbcore.scheduling.router import ReplicaView, Router, RouteRequest, RouterError
    from cbcore.scheduling.sampling_params import SamplingParams
    from cbcore.scheduling.scheduler import (
        Scheduler,
        SchedulerError,
        SchedulerOutput,
        SchedulerPlugin,
        SchedulerStall,
    )
    from cbcore.scheduling.sequence import FinishReason, Sequence
    from cbcore.stats import EngineLoad
