"""Incremental detokenisation: text from tokens as they arrive, one piece at a time.

Decoding token by token breaks in two ways: a character may span several
byte-level tokens (its first pieces decode to U+FFFD), and tokenizers that
merge a leading space into the next word need the previous token to decode a
piece correctly. :class:`IncrementalDetokenizer` therefore decodes a short
window (the tokens already shown plus the new ones) and emits only the part
of the text that is new and complete. `cb generate --stream` and the server
both use it.
"""

from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0  # start of the decode window: the last emitted piece
        self.read = 0  # tokens up to here have been emitted as text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_ids: list[int]) -> str:
        """Add tokens; return the text they complete (possibly empty)."""
        self.ids.extend(token_ids)
        shown = self._decode(self.ids[self.prefix : self.read])
        text = self._decode(self.ids[self.prefix :])
        if len(text) > len(shown) and not text.endswith(REPLACEMENT):
            self.prefix, self.read = self.read, len(self.ids)
            return text[len(shown) :]
        return ""

    def flush(self) -> str:
        """The text still held back (an incomplete character at the very end)."""
        shown = self._decode(self.ids[self.prefix : self.read])
        text = self._decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return text[len(shown) :]
