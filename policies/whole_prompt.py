"""Prefill each prompt in one piece."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from cbcore.scheduling.policy import PrefillPolicy, SequenceView


class WholePromptParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    order: Literal["decode-first", "prefill-first"] = Field(
        "decode-first",
        description="decode-first serves running decodes before admitting prompts; prefill-first "
        "admits new prompts first (higher throughput, decodes may wait).",
    )


class WholePrompt(PrefillPolicy):
    """A prompt runs whole or waits for a step with room for all of it.

    A prompt longer than the whole token budget could never run under that
    rule, so it runs alone in a step instead (the budget is exceeded for that
    step, never silently: use ``chunked-prefill`` to honour it strictly).
    """

    name = "whole-prompt"
    Params = WholePromptParams

    def __init__(self, params: WholePromptParams | None = None) -> None:
        super().__init__(params)
        self.order = self.params.order

    def num_tokens(self, seq: SequenceView, tokens_left: int, batch_empty: bool) -> int:
        pending = seq.num_pending_tokens
        return pending if pending <= tokens_left or batch_empty else 0
