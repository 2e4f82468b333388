"""cbcore: continuous-batching LLM inference with pluggable policies and backends."""

from __future__ import annotations

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

__version__ = "0.1.0"

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
