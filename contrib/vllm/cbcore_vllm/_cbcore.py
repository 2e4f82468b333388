"""Every name this package takes from cbcore, in one place.

cbcore's core is being reorganised (modules move, the scheduling API may be
renamed); keeping the imports here makes following it a one-file change. The
rest of the package imports cbcore only through this module.
"""

from __future__ import annotations

from cbcore.config import ConfigError, EngineConfig, format_validation_error
from cbcore.plugins import PluginError, get_registry
from cbcore.scheduling.blame import blame, describe
from cbcore.scheduling.plan_builder import OrderedOnDemand
from cbcore.scheduling.policy import (
    BudgetPolicy,
    Policy,
    PreemptionPolicy,
    PrefillPolicy,
    QueuePolicy,
    SchedulerState,
    SequenceView,
    StepLimits,
    StepResult,
)
from cbcore.scheduling.request_fields import (
    EMPTY_ATTRS,
    FieldError,
    check_client_id,
    check_deadline,
    freeze_attrs,
)
from cbcore.scheduling.sampling_params import SamplingParams
from cbcore.scheduling.scheduler import SchedulerError

# The built-in prefill policies the adapter translates into vLLM's own knobs.
from cbcore.policies.chunked_prefill import ChunkedPrefill  # isort: skip
from cbcore.policies.whole_prompt import WholePrompt  # isort: skip

SLOTS = ("queue", "budget", "prefill", "preemption")

__all__ = [
    "EMPTY_ATTRS",
    "SLOTS",
    "BudgetPolicy",
    "ChunkedPrefill",
    "ConfigError",
    "EngineConfig",
    "FieldError",
    "OrderedOnDemand",
    "PluginError",
    "Policy",
    "PreemptionPolicy",
    "PrefillPolicy",
    "QueuePolicy",
    "SamplingParams",
    "SchedulerError",
    "SchedulerState",
    "SequenceView",
    "StepLimits",
    "StepResult",
    "WholePrompt",
    "blame",
    "check_client_id",
    "check_deadline",
    "describe",
    "format_validation_error",
    "freeze_attrs",
    "get_registry",
]
