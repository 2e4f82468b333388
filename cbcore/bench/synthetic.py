"""Prompts held as a recipe (length, seed, shared blocks) and drawn as token ids when a run needs them.

A trace gives token counts, not text. Its prompts are token ids drawn
uniformly from the model's vocabulary without its special ids, from a
*counter-based* random stream: id ``j`` of the stream keyed ``(seed, key)``
is a fixed mix of those three numbers (splitmix64's finaliser), so any
stretch of any stream is computed directly, in one vectorised pass, without
drawing what comes before it. That is what lets a workload of 145 million
prompt tokens (Mooncake's hour) be held as 12,031 small records: each engine
that serves a request draws exactly the same ids, and only while it runs.

Two kinds of stream:

* a request's own prompt, keyed by its row in the trace (Azure and other
  traces without prefix information): no two rows share a token stream;
* shared blocks (Mooncake's ``hash_ids``): block ``h`` of a prompt is the
  first ids of the stream keyed ``(seed, h)``, so equal hash ids give equal
  blocks and requests whose hash ids share a leading run share that prefix
  token for token; the prompt's last block is cut to its length. Block ``i``
  covers tokens ``floor(i * B)`` to ``floor((i + 1) * B)`` of the prompt, with
  ``B`` the trace's block length (512 in Mooncake, scaled with the lengths).
"""

from __future__ import annotations

import functools
import math
from array import array
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from typing import overload

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

# splitmix64's constants (Steele, Lea and Flood, OOPSLA 2014).
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)
# Stream domains, so that a row's own stream never equals a shared block's.
DOMAIN_BLOCK = 0x5EED_B10C
DOMAIN_ROW = 0x5EED_0404


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on a uint64 array (array arithmetic wraps modulo 2**64)."""
    z = (z ^ (z >> np.uint64(30))) * _MUL1
    z = (z ^ (z >> np.uint64(27))) * _MUL2
    return z ^ (z >> np.uint64(31))


def stream_keys(seed: int, domain: int, keys: Seq[int]) -> np.ndarray:
    """One 64-bit key per stream ``(seed, domain, key)``."""
    base = _mix(np.array([(seed * 0x1_0000_0001 + domain) % 2**64], dtype=np.uint64))
    return _mix(base + np.asarray(keys, dtype=np.uint64) * _GOLDEN)


@functools.lru_cache(maxsize=8)
def ordinary_ids(vocab_size: int, special_ids: tuple[int, ...]) -> np.ndarray:
    """The ids a prompt may hold: the vocabulary without its special ids (as int64)."""
    ids = np.setdiff1d(np.arange(vocab_size, dtype=np.int64), np.asarray(special_ids, dtype=np.int64))
    if ids.size == 0:
        raise ValueError(f"the vocabulary of {vocab_size} ids has no ordinary ids to draw prompts from")
    return ids


class SyntheticPrompt(BaseModel):
    """A prompt of ``tokens`` ids drawn as the module says; JSON-serialisable, so a trace replays exactly.

    Give ``row`` (the prompt is the start of that row's own stream) or
    ``hash_ids`` (the prompt is those shared blocks, the last one cut).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    tokens: int = Field(ge=1, description="Prompt length in tokens.")
    seed: int = Field(0, ge=0, lt=2**63)
    row: int | None = Field(None, ge=0, description="Key of the prompt's own stream (its row in the trace).")
    hash_ids: tuple[StrictInt, ...] | None = Field(None, strict=False, description="Shared blocks, in order.")
    block_tokens: float = Field(512.0, ge=1, description="Tokens per shared block (the last one is cut).")
    vocab_size: int = Field(ge=1)
    special_ids: tuple[int, ...] = Field((), description="Ids never drawn (the tokenizer's special tokens).")

    @model_validator(mode="after")
    def _one_source(self) -> SyntheticPrompt:
        if (self.row is None) == (self.hash_ids is None):
            raise ValueError("give exactly one of 'row' (the prompt's own stream) or 'hash_ids' (shared blocks)")
        if self.hash_ids is not None:
            if min(self.hash_ids, default=0) < 0:
                raise ValueError("hash_ids holds a negative id")
            want = blocks_for(self.tokens, self.block_tokens)
            if len(self.hash_ids) != want:
                raise ValueError(
                    f"{len(self.hash_ids)} hash_ids for {self.tokens} tokens in blocks of "
                    f"{self.block_tokens:g}: expected {want}"
                )
        return self

    def ids(self) -> list[int]:
        """The prompt's token ids (a fresh list each call)."""
        return draw_ids(self).tolist()

    def ids_array(self) -> array[int]:
        """The prompt's token ids as a fresh ``array('i')``: 4 bytes an id, no Python int per token."""
        if self.vocab_size > 2**31:
            raise ValueError(f"a vocabulary of {self.vocab_size} ids does not fit 32-bit token arrays")
        return array("i", draw_ids(self).astype(np.int32).tobytes())


def blocks_for(tokens: int, block_tokens: float) -> int:
    """How many blocks a prompt of ``tokens`` spans when block ``i`` ends at ``floor((i + 1) * B)``."""
    n = max(1, math.ceil(tokens / block_tokens))
    while math.floor((n - 1) * block_tokens) >= tokens:  # float rounding at a boundary
        n -= 1
    while math.floor(n * block_tokens) < tokens:
        n += 1
    return n


def draw_ids(prompt: SyntheticPrompt) -> np.ndarray:
    """The token ids of ``prompt`` as an int64 array."""
    n = prompt.tokens
    if prompt.hash_ids is None:
        keys = np.repeat(stream_keys(prompt.seed, DOMAIN_ROW, [prompt.row or 0]), n)
        counters = np.arange(n, dtype=np.uint64)
    else:
        bounds = np.floor(np.arange(len(prompt.hash_ids) + 1) * prompt.block_tokens).astype(np.int64)
        bounds[-1] = n
        lengths = np.diff(bounds)
        keys = np.repeat(stream_keys(prompt.seed, DOMAIN_BLOCK, prompt.hash_ids), lengths)
        counters = (np.arange(n, dtype=np.int64) - np.repeat(bounds[:-1], lengths)).astype(np.uint64)
    values = _mix(keys + (counters + np.uint64(1)) * _GOLDEN)
    table = ordinary_ids(prompt.vocab_size, prompt.special_ids)
    return table[values % np.uint64(table.size)]


class PromptIds(Seq[int]):
    """A synthetic prompt as a read-only sequence: its length at once, its ids drawn when read.

    The simulator hands these to the driver instead of lists, so a workload's
    prompts are never all in memory; a simulated engine gets the ids as an
    ``array('i')`` when the request is submitted (:meth:`array`), and a
    finished request's output keeps this object, not the ids.
    """

    __slots__ = ("prompt",)

    def __init__(self, prompt: SyntheticPrompt) -> None:
        self.prompt = prompt

    def __len__(self) -> int:
        return self.prompt.tokens

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...
    def __getitem__(self, index: int | slice) -> int | list[int]:
        return self.prompt.ids()[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self.prompt.ids())

    def array(self) -> array[int]:
        return self.prompt.ids_array()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PromptIds):
            return self.prompt == other.prompt
        return isinstance(other, Seq) and list(other) == self.prompt.ids()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"PromptIds({self.prompt.tokens} tokens)"
