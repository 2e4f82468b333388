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
from cbcore.scheduling.door import SIGNALLED, Door, PolicyError
from cbcore.scheduling.policy import (
    BudgetPolicy,
    LazyViews,
    PreemptionPolicy,
    PrefillPolicy,
    QueuePolicy,
    SchedulerState,
    SequenceView,
    StepLimits,
    StepResult,
)
from cbcore.scheduling.request import EMPTY_ATTRS, RequestFields, field_problems
from cbcore.scheduling.sampling_params import SamplingParams
from cbcore.scheduling.scheduler import SchedulerError

# The decision check (cbcore_vllm.check): cbcore's engine, config files and workloads.
from cbcore.engine import Engine  # isort: skip
from cbcore.config import read_config_file  # isort: skip
from cbcore.bench.sources import load_workload  # isort: skip
from cbcore.bench.workload import WorkloadError  # isort: skip

# The built-in policies the adapter translates into vLLM's own knobs, or refuses.
from cbcore.policies.chunked_prefill import ChunkedPrefill  # isort: skip
from cbcore.policies.lpm import LongestPrefixMatch  # isort: skip
from cbcore.policies.whole_prompt import WholePrompt  # isort: skip

__all__ = [
    "EMPTY_ATTRS",
    "SIGNALLED",
    "SLOTS",
    "BudgetPolicy",
    "ChunkedPrefill",
    "ConfigError",
    "Door",
    "Engine",
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
    "WorkloadError",
    "field_problems",
    "format_validation_error",
    "get_registry",
    "load_workload",
    "read_config_file",
]
