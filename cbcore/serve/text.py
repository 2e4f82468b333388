"""One request's output text as it streams: incremental decoding plus stop strings.

Stop strings are matched on decoded text, as OpenAI does, so a stop string
split across tokens (or inside one token) still ends the request, and the
stop string itself is never emitted. Text that could be the beginning of a
stop string is held back until the next token says whether it is one.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

from cbcore.models.detokenize import IncrementalDetokenizer


@dataclass(frozen=True)
class TextDelta:
    """What to send for one engine delta: new text, the tokens it came from, and whether it ends."""

    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" / "length" once finished


class TextStream:
    def __init__(self, tokenizer: Any, stop: Seq[str] | None = None) -> None:
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stop = list(stop or ())
        self.text = ""  # everything decoded so far (emitted and held back)
        self.emitted = 0  # len of the text already handed out
        self.num_tokens = 0  # tokens that count towards the output (up to the stop match)
        self.finished = False

    def push(self, token_ids: list[int], finish_reason: str | None) -> TextDelta:
        """Add one engine delta; after a stop-string match the request is over (``finished``)."""
        if self.finished:
            raise RuntimeError("the text stream has already finished")
        piece = self.detok.push(token_ids)
        if finish_reason is not None:
            piece += self.detok.flush()
        self.text += piece
        self.num_tokens += len(token_ids)
        cut = self._find_stop()
        if cut is not None:
            self.text = self.text[:cut]
            return self._emit(len(self.text), token_ids, "stop")
        if finish_reason is not None:
            return self._emit(len(self.text), token_ids, finish_reason)
        return self._emit(len(self.text) - self._held_back(), token_ids, None)

    def _emit(self, upto: int, token_ids: list[int], finish_reason: str | None) -> TextDelta:
        out = self.text[self.emitted : upto]
        self.emitted = upto
        self.finished = finish_reason is not None
        return TextDelta(out, list(token_ids), finish_reason)

    def _find_stop(self) -> int | None:
        """Where the earliest stop string starts, searching only text not yet handed out."""
        hits = [i for s in self.stop if (i := self.text.find(s, self.emitted)) >= 0]
        return min(hits) if hits else None

    def _held_back(self) -> int:
        """Length of the longest tail of the pending text that begins some stop string."""
        pending = self.text[self.emitted :]
        longest = min(len(pending), max((len(s) - 1 for s in self.stop), default=0))
        for k in range(longest, 0, -1):
            tail = pending[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0
