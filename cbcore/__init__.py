"""cbcore: continuous-batching LLM inference with pluggable policies and backends.

The public API is what a plugin author and an engine user need; everything
else is reachable by its submodule (``cbcore.scheduling.scheduler`` for a
whole-scheduler plugin, ``cbcore.execution.batch`` for a backend's batch).
Names are imported lazily: ``import cbcore.policies`` (what a plugin or
``cb plugins`` needs) must not pay for importing transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    # running an engine
    "Engine": "cbcore.engine",
    "EngineConfig": "cbcore.config",
    "SamplingParams": "cbcore.scheduling.sampling_params",
    "RequestOutput": "cbcore.outputs",
    "RequestMetrics": "cbcore.outputs",
    "EngineLoad": "cbcore.outputs",
    "FinishReason": "cbcore.scheduling.sequence",
    "RequestError": "cbcore.scheduling.request",
    # writing a policy
    "QueuePolicy": "cbcore.scheduling.policy",
    "BudgetPolicy": "cbcore.scheduling.policy",
    "PrefillPolicy": "cbcore.scheduling.policy",
    "PreemptionPolicy": "cbcore.scheduling.policy",
    "SequenceView": "cbcore.scheduling.policy",
    "KVView": "cbcore.scheduling.policy",
    "SchedulerState": "cbcore.scheduling.policy",
    "StepLimits": "cbcore.scheduling.policy",
    "StepResult": "cbcore.scheduling.policy",
    "SchedulerError": "cbcore.scheduling.scheduler",
    "SchedulerStall": "cbcore.scheduling.scheduler",
    # writing a router or a backend, and registering plugins
    "Router": "cbcore.scale.router",
    "RouteRequest": "cbcore.scale.router",
    "ReplicaView": "cbcore.scale.router",
    "RouterError": "cbcore.scale.router",
    "Backend": "cbcore.execution.backend",
    "BackendUnavailable": "cbcore.execution.backend",
    "NoParams": "cbcore.plugins",
    "PluginError": "cbcore.plugins",
    "hookimpl": "cbcore.plugins",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'cbcore' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
