"""Split long prefills into chunks that share steps with decodes (Sarathi-Serve)."""

from __future__ import annotations

from typing import Literal

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
    order: Literal["decode-first", "prefill-first"] = Field(
        "decode-first",
        description="decode-first is Sarathi's stall-free order: decodes never wait for a prefill.",
    )


class ChunkedPrefill(PrefillPolicy):
    """Fill what the token budget leaves with prompt chunks; never exceed it.

    With the default decode-first order, every running decode gets its token
    first, then ongoing chunks, then new prompts: a long prompt can no longer
    stall the decodes of everyone else (the stall Sarathi-Serve removes).
    """

    name = "chunked-prefill"
    Params = ChunkedPrefillParams

    def __init__(self, params: ChunkedPrefillParams | None = None) -> None:
        super().__init__(params)
        self.order = self.params.order
        self._long_this_step = 0

    def begin_step(self) -> None:
        self._long_this_step = 0

    def num_tokens(self, seq: SequenceView, tokens_left: int, batch_empty: bool) -> int:
        pending = seq.num_pending_tokens
        threshold = self.params.long_prefill_threshold
        if threshold is not None and pending > threshold:
            if self._long_this_step >= self.params.max_long_prefills:
                return 0
            self._long_this_step += 1
        n = min(pending, tokens_left)
        if self.params.chunk_size is not None:
            n = min(n, self.params.chunk_size)
        return n
