"""Prefill each prompt in one piece."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from cbcore.scheduling.policy import PrefillPolicy, SequenceView


class WholePrompt(PrefillPolicy):
    """A prompt runs whole or waits for a step with room for all of it.

    A prompt longer than the whole token budget could never run under that
    rule, so it runs alone in a step instead (the budget is exceeded for that
    step, never silently: use ``chunked-prefill`` to honour it strictly).
    """

    name = "whole-prompt"

    def num_tokens(self, seq: SequenceView, tokens_left: int, scheduled: Seq[SequenceView]) -> int:
        pending = seq.num_pending_tokens
        return pending if pending <= tokens_left or not scheduled else 0
