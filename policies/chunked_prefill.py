"""Split long prefills into chunks that share steps with decodes (Sarathi-Serve)."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from pydantic import BaseModel, ConfigDict, Field

from cbcore.scheduling.policy import PrefillPolicy, SequenceView


class ChunkedPrefillParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    chunk_size: int | None = Field(
        None, ge=1, description="Most prompt tokens of one sequence per step; None: what the budget leaves."
    )
    long_prefill_threshold: int | None = Field(
        None, ge=1, description="Prefills with more pending tokens than this count as long."
    )
    max_long_prefills: int = Field(
        1, ge=1, description="Most long prefills in one step, so short prompts are not stuck behind them."
    )


class ChunkedPrefill(PrefillPolicy):
    """Fill what the token budget leaves with prompt chunks; never exceed it.

    Under the default decode-first order (``scheduler.order``), every running
    decode gets its token first, then ongoing chunks, then new prompts: a long
    prompt can no longer stall the decodes of everyone else (the stall
    Sarathi-Serve removes).
    """

    name = "chunked-prefill"
    Params = ChunkedPrefillParams

    def num_tokens(self, seq: SequenceView, tokens_left: int, scheduled: Seq[SequenceView]) -> int:
        pending = seq.num_pending_tokens
        threshold = self.params.long_prefill_threshold
        if threshold is not None and pending > threshold:
            long_ones = sum(1 for s in scheduled if s.num_pending_tokens > threshold)
            if long_ones >= self.params.max_long_prefills:
                return 0
        n = min(pending, tokens_left)
        if self.params.chunk_size is not None:
            n = min(n, self.params.chunk_size)
        return n
