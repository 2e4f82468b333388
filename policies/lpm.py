"""Longest cached prefix first: serve the requests whose KV is already mostly there (SGLang's LPM)."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from pydantic import BaseModel, ConfigDict, Field

from cbcore.scheduling.policy import QueuePolicy, SequenceView


class LPMParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    fcfs_above: int = Field(
        128,
        ge=0,
        description="With more waiting requests than this, serve in arrival order: looking every "
        "waiting request up in the cache each step would cost more than the order saves.",
    )


class LongestPrefixMatch(QueuePolicy):
    """Most cached prompt tokens first; ties, and long queues, in arrival order.

    Admitting the request with the longest cached prefix first uses the cache
    while it still holds that prefix: requests of one conversation or one
    system prompt run close together, fewer cached blocks are evicted before
    their reuse, and less prefill is computed. The order reads
    ``num_cached_prompt_tokens``, which a waiting request's view looks up in
    the cache when it is read (so only while the queue is no longer
    than ``fcfs_above``). Without prefix caching every count is 0 and this is
    FCFS. Running sequences are ordered the same way (the last is evicted first),
    by the count found when they were admitted.
    """

    name = "lpm"
    Params = LPMParams

    def key(self, seq: SequenceView, now: float) -> tuple[int, float, str]:
        return (-seq.num_cached_prompt_tokens, seq.arrival_time, seq.request_id)

    def order(self, seqs: Seq[SequenceView], now: float) -> list[SequenceView]:
        if len(seqs) > self.params.fcfs_above:
            return sorted(seqs, key=lambda s: (s.arrival_time, s.request_id))
        return sorted(seqs, key=lambda s: (-s.num_cached_prompt_tokens, s.arrival_time, s.request_id))
