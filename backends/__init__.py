"""Built-in attention backends, registered through the same hook as any plugin."""

from __future__ import annotations

from cbcore.backends.eager import EagerBackend
from cbcore.backends.flash_varlen import FlashVarlenBackend
from cbcore.backends.sdpa import SdpaBackend
from cbcore.plugins import hookimpl

BUILTIN_BACKENDS: list[type] = [EagerBackend, SdpaBackend, FlashVarlenBackend]


@hookimpl
def cbcore_register_backends() -> list[type]:
    return list(BUILTIN_BACKENDS)


__all__ = ["BUILTIN_BACKENDS", "EagerBackend", "FlashVarlenBackend", "SdpaBackend"]
