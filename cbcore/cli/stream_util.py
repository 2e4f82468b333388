"""Streaming text as tokens arrive.

Decoding token by token breaks in two ways: a character may span several
byte-level tokens (its first pieces decode to U+FFFD), and tokenizers that
merge a leading space into the next word need the previous token to decode a
piece correctly. :class:`IncrementalDetokenizer` therefore decodes a short
window (the tokens already shown plus the new ones) and emits only the part
of the text that is new and complete.
"""

from __future__ import annotations

from typing import Any, TextIO

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


class OrderedStream:
    """Streams several concurrent requests to one terminal without interleaving them.

    The earliest unfinished request streams live; later ones are buffered and
    written out, in order, as soon as every request before them is done.
    """

    def __init__(self, tokenizer: Any, order: list[str], headers: dict[str, str], out: TextIO) -> None:
        self.order = order
        self.headers = headers
        self.out = out
        self.detok = {rid: IncrementalDetokenizer(tokenizer) for rid in order}
        self.pending: dict[str, list[str]] = {rid: [] for rid in order}
        self.done: set[str] = set()
        self.head = 0
        self._started = False
        self._advance()

    def update(self, request_id: str, new_token_ids: list[int], finished: bool) -> None:
        detok = self.detok[request_id]
        piece = detok.push(new_token_ids)
        if finished:
            piece += detok.flush()
            self.done.add(request_id)
        if piece:
            self.pending[request_id].append(piece)
        self._advance()

    def _advance(self) -> None:
        while self.head < len(self.order):
            rid = self.order[self.head]
            if not self._started:
                self.out.write(self.headers.get(rid, ""))
                self._started = True
            self.out.write("".join(self.pending[rid]))
            self.pending[rid].clear()
            self.out.flush()
            if rid not in self.done:
                return
            self.out.write("\n")
            self.head += 1
            self._started = False
