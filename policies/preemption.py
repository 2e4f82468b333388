"""Eviction when the KV cache cannot grow: recompute or swap, and whom."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from cbcore.scheduling.policy import PreemptionPolicy, QueuePolicy, SequenceView

Victim = Literal["newest", "lowest-priority", "least-progress", "queue-order"]
Mode = Literal["recompute", "swap"]
MODE_HELP = (
    "recompute: free the victim's KV, it prefills again when it returns; swap: copy its KV to host memory "
    "and back (recompute when the host pool is full)."
)


class PreemptionParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    mode: Mode = Field("recompute", description=MODE_HELP)
    victim: Victim = Field(
        "newest",
        description="newest arrival; lowest priority (highest value, then newest); least progress "
        "(fewest computed tokens: cheapest to redo); or the queue policy's last.",
    )


def pick_victim(
    victim: Victim, candidates: Seq[SequenceView], queue: QueuePolicy, now: float
) -> SequenceView:
    if victim == "newest":
        return max(candidates, key=lambda s: (s.arrival_time, s.request_id))
    if victim == "lowest-priority":
        return max(candidates, key=lambda s: (s.priority, s.arrival_time, s.request_id))
    if victim == "least-progress":
        return min(candidates, key=lambda s: (s.num_computed_tokens, -s.arrival_time, s.request_id))
    return queue.order(candidates, now)[-1]


class SwapParams(PreemptionParams):
    mode: Mode = Field("swap", description=MODE_HELP)


class _ByVictimRule(PreemptionPolicy):
    Params = PreemptionParams

    def choose_victim(self, candidates: Seq[SequenceView], queue: QueuePolicy, now: float) -> SequenceView:
        return pick_victim(self.params.victim, candidates, queue, now)


class Recompute(_ByVictimRule):
    """Free the victim's blocks; it re-prefills prompt + output when it returns.

    Costs compute, no memory. Greedy outputs are unchanged: the recomputed
    prefill yields the same KV as the decodes it replaces.
    """

    name = "recompute"


class Swap(_ByVictimRule):
    """Copy the victim's blocks to host memory and back; nothing is recomputed.

    When the host pool (``kv_cache.num_host_blocks``) has no room, the victim
    is recomputed instead and a warning is logged.
    """

    name = "swap"
    Params = SwapParams
