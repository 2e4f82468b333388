"""The entry point cbcore loads (group ``cbcore``): registers the ``edf`` and ``edf-demote`` queue policies."""

from __future__ import annotations

from cbcore import hookimpl
from cbcore_edf.policy import EarliestDeadlineFirst, EDFDemote


@hookimpl
def cbcore_register_policies() -> list[type]:
    return [EarliestDeadlineFirst, EDFDemote]
