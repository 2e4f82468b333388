"""The entry point cbcore loads (group ``cbcore``): registers the ``mlfq`` queue policy."""

from __future__ import annotations

from cbcore import hookimpl
from cbcore_mlfq.policy import SkipJoinMLFQ


@hookimpl
def cbcore_register_policies() -> list[type]:
    return [SkipJoinMLFQ]
