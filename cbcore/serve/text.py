"""One request's output text as it streams: incremental decoding plus stop strings.

Stop strings are matched on decoded text, as OpenAI does, so a stop string
split across tokens (or inside one token) still ends the request, and the
stop string itself is never emitted. Text that could be the beginning of a
stop string is held back until the next token says whether it is one. The
matching (:mod:`cbcore.serve.stops`) reads each new character once, so a
token costs the same whatever the number of stop strings.

A request cut by ``max_tokens`` (or ended by EOS) in the middle of a
multi-byte character ends its text before that character: half a character
would decode to U+FFFD, which the model never wrote. Its tokens still count.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

from cbcore.models.detokenize import REPLACEMENT, IncrementalDetokenizer
from cbcore.serve.stops import StopMatcher


@dataclass(frozen=True)
class TextDelta:
    """What to send for one engine delta: new text, the tokens it came from, and whether it ends."""

    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" / "length" once finished


class TextStream:
    def __init__(self, tokenizer: Any, stop: Seq[str] | None = None) -> None:
        self.detok = IncrementalDetokenizer(tokenizer)
        self.matcher = StopMatcher(tuple(stop)) if stop else None
        self.pending = ""  # decoded, not yet handed out: a tail that may begin a stop string
        self.num_tokens = 0  # tokens that count towards the output (up to the stop match)
        self.finished = False

    def push(self, token_ids: list[int], finish_reason: str | None) -> TextDelta:
        """Add one engine delta; after a stop-string match the request is over (``finished``)."""
        if self.finished:
            raise RuntimeError("the text stream has already finished")
        piece = self.detok.push(token_ids)
        if finish_reason is not None:
            # What the detokenizer still holds is an incomplete character: never emitted half.
            piece += self.detok.flush().rstrip(REPLACEMENT)
        self.num_tokens += len(token_ids)
        if self.matcher is not None:
            hit = self.matcher.feed(piece)
            if hit is not None:
                end, length = hit
                text = self.pending + piece[:end]
                return self._end(text[: len(text) - length], token_ids, "stop")
        text = self.pending + piece
        if finish_reason is not None:
            return self._end(text, token_ids, finish_reason)
        held = self.matcher.held if self.matcher is not None else 0
        cut = len(text) - held
        self.pending = text[cut:]
        return TextDelta(text[:cut], list(token_ids), None)

    def _end(self, text: str, token_ids: list[int], finish_reason: str) -> TextDelta:
        self.pending = ""
        self.finished = True
        return TextDelta(text, list(token_ids), finish_reason)
