"""Skip-join multi-level feedback queue (FastServe), as a cbcore queue policy."""

from __future__ import annotations

from cbcore_mlfq.policy import MLFQParams, SkipJoinMLFQ

__all__ = ["MLFQParams", "SkipJoinMLFQ"]
