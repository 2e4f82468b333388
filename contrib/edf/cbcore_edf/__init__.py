"""Earliest deadline first, as a cbcore queue policy."""

from __future__ import annotations

from cbcore_edf.policy import EarliestDeadlineFirst, EDFDemote, EDFDemoteParams, EDFParams

__all__ = ["EDFDemote", "EDFDemoteParams", "EDFParams", "EarliestDeadlineFirst"]
