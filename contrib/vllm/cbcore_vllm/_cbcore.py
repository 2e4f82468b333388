"""Every name this package takes from cbcore, in one place.

The rest of the package imports cbcore only through this module, so a move
inside cbcore's core is a one-file change here. The policies are asked
through cbcore's own :class:`Door` (each answer checked, each failure named
as cbcore's engine names it) and requests are checked by cbcore's own
:class:`RequestFields`: a plugin behaves, and misbehaves, the same in both
engines because it meets the same code.
"""

from __future__ import annotations

from cbcore.config import SLOTS, ConfigError, EngineConfig, format_validation_error
from cbcore.plugins import PluginError, get_registry
from cbcore.scheduling.door import Door, PolicyError
from cbcore.scheduling.policy import (
    BudgetPolicy,
    PreemptionPolicy,
    PrefillPolicy,
    QueuePolicy,
    SchedulerState,
    SequenceView,
    StepLimits,
    StepResult,
)
from cbcore.scheduling.policy_scheduler import LazyViews
from cbcore.scheduling.request import EMPTY_ATTRS, RequestFields, field_problems
from cbcore.scheduling.sampling_params import SamplingParams
from cbcore.scheduling.scheduler import SchedulerError

# The built-in policies the adapter translates into vLLM's own knobs, or refuses.
from cbcore.policies.chunked_prefill import ChunkedPrefill  # isort: skip
from cbcore.policies.lpm import LongestPrefixMatch  # isort: skip
from cbcore.policies.whole_prompt import WholePrompt  # isort: skip

__all__ = [
    "EMPTY_ATTRS",
    "SLOTS",
    "BudgetPolicy",
    "ChunkedPrefill",
    "ConfigError",
    "Door",
    "EngineConfig",
    "LazyViews",
    "LongestPrefixMatch",
    "PluginError",
    "PolicyError",
    "PreemptionPolicy",
    "PrefillPolicy",
    "QueuePolicy",
    "RequestFields",
    "SamplingParams",
    "SchedulerError",
    "SchedulerState",
    "SequenceView",
    "StepLimits",
    "StepResult",
    "WholePrompt",
    "field_problems",
    "format_validation_error",
    "get_registry",
]
