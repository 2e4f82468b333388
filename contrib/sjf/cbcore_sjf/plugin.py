"""The entry point cbcore loads (group ``cbcore``): registers the ``sjf`` queue policy."""

from __future__ import annotations

from cbcore import hookimpl
from cbcore_sjf.policy import ShortestPredictedJobFirst


@hookimpl
def cbcore_register_policies() -> list[type]:
    return [ShortestPredictedJobFirst]
