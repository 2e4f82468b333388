"""Built-in attention backends, registered through the same hook as any plugin.

The classes are imported when the hook is called (the first time a backend is
looked up), not with this package: they import torch, which a process that
runs no model never loads.
"""

from __future__ import annotations

from cbcore.plugins import hookimpl


@hookimpl
def cbcore_register_backends() -> list[type]:
    from cbcore.backends.eager import EagerBackend
    from cbcore.backends.flash_varlen import FlashVarlenBackend
    from cbcore.backends.sdpa import SdpaBackend

    return [EagerBackend, SdpaBackend, FlashVarlenBackend]
