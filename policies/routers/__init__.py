"""Built-in routers: which replica serves a request (see :mod:`cbcore.scale.router`)."""

from __future__ import annotations

from cbcore.policies.routers.least_loaded import LeastLoaded
from cbcore.policies.routers.power_of_two import PowerOfTwo
from cbcore.policies.routers.prefix_affinity import PrefixAffinity
from cbcore.policies.routers.round_robin import RoundRobin

BUILTIN_ROUTERS = [RoundRobin, LeastLoaded, PowerOfTwo, PrefixAffinity]

__all__ = ["BUILTIN_ROUTERS", "LeastLoaded", "PowerOfTwo", "PrefixAffinity", "RoundRobin"]
