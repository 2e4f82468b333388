"""Fair share across clients by virtual token counters, as a cbcore queue policy."""

from __future__ import annotations

from cbcore_vtc.policy import VirtualTokenCounter, VTCParams

__all__ = ["VTCParams", "VirtualTokenCounter"]
