"""The entry point cbcore loads (group ``cbcore``): registers the ``vtc`` queue policy."""

from __future__ import annotations

from cbcore import hookimpl
from cbcore_vtc.policy import VirtualTokenCounter


@hookimpl
def cbcore_register_policies() -> list[type]:
    return [VirtualTokenCounter]
