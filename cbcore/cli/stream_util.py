"""Streaming several requests' text to one terminal as tokens arrive (`cb generate --stream`)."""

from __future__ import annotations

from typing import Any, TextIO

from cbcore.models.detokenize import IncrementalDetokenizer


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
