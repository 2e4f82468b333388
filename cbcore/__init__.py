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
    name: module
    for module, names in {
        # running an engine
        "cbcore.engine": ["Engine"],
        "cbcore.config": ["EngineConfig"],
        "cbcore.scheduling.sampling_params": ["SamplingParams"],
        "cbcore.outputs": ["RequestOutput", "RequestMetrics"],
        "cbcore.scheduling.sequence": ["FinishReason"],
        "cbcore.scheduling.request": ["RequestError"],
        # writing a policy
        "cbcore.scheduling.policy": [
            "QueuePolicy", "BudgetPolicy", "PrefillPolicy", "PreemptionPolicy", "SequenceView",
            "SchedulerState", "StepLimits", "StepResult",
        ],
        "cbcore.scheduling.scheduler": ["SchedulerError", "SchedulerStall"],
        # writing a router or a backend, and registering plugins
        "cbcore.scale.router": ["Router", "RouteRequest", "ReplicaView", "RouterError", "EngineLoad", "engine_load"],
        "cbcore.execution.backend": ["Backend", "BackendUnavailable"],
        "cbcore.plugins": ["NoParams", "PluginError", "hookimpl"],
    }.items()
    for name in names
}

__all__ = [*_EXPORTS, "__version__"]


#: Names that left the public API, with what replaces them.
_GONE = {"KVView": "state.kv is the KV cache's read-only view; annotate it as Any"}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        hint = f": {_GONE[name]}" if name in _GONE else ""
        raise AttributeError(f"module 'cbcore' has no attribute {name!r}{hint}")
    value = globals()[name] = getattr(importlib.import_module(_EXPORTS[name]), name)
    return value


def __dir__() -> list[str]:
    return __all__
