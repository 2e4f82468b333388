"""Built-in scheduling policies, registered through the same hook as any plugin."""

from __future__ import annotations

from cbcore.plugins import hookimpl
from cbcore.policies.chunked_prefill import ChunkedPrefill
from cbcore.policies.fcfs import FCFS
from cbcore.policies.lpm import LongestPrefixMatch
from cbcore.policies.preemption import Recompute, Swap
from cbcore.policies.priority import Priority
from cbcore.policies.routers import BUILTIN_ROUTERS, LeastLoaded, PowerOfTwo, PrefixAffinity, RoundRobin
from cbcore.policies.static import Static
from cbcore.policies.token_budget import TokenBudget
from cbcore.policies.whole_prompt import WholePrompt

BUILTIN_POLICIES = [FCFS, LongestPrefixMatch, Priority, TokenBudget, Static, WholePrompt, ChunkedPrefill, Recompute, Swap]


@hookimpl
def cbcore_register_policies() -> list[type]:
    return [*BUILTIN_POLICIES, *BUILTIN_ROUTERS]


__all__ = [
    "BUILTIN_POLICIES",
    "BUILTIN_ROUTERS",
    "FCFS",
    "ChunkedPrefill",
    "LeastLoaded",
    "LongestPrefixMatch",
    "PowerOfTwo",
    "PrefixAffinity",
    "Priority",
    "Recompute",
    "RoundRobin",
    "Static",
    "Swap",
    "TokenBudget",
    "WholePrompt",
]
