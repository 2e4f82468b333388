"""One request's state as it moves through the engine, and the read-only view policies get of it."""

from __future__ import annotations

import enum
import time
from array import array
from collections.abc import Iterator, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn

from cbcore.scheduling.request import EMPTY_ATTRS
from cbcore.scheduling.sampling_params import SamplingParams

if TYPE_CHECKING:  # torch is imported where a seeded request needs it: cb simulate never loads it
    import torch


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no KV blocks (new, or preempted by recompute)
    RUNNING = "running"  # holds KV blocks in the device cache
    SWAPPED = "swapped"  # preempted by swap: its KV lives in host memory
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS or a stop token
    LENGTH = "length"  # max_new_tokens or the model's context length
    ABORT = "abort"  # cancelled by the caller
    ERROR = "error"  # the request could not be served (see Sequence.error)


@dataclass(eq=False)  # sequences are identities, kept in sets and dicts (C-level id hash)
class Sequence:
    """The mutable state of one request; only the engine writes it.

    ``token_ids`` holds prompt and generated tokens in one list because the
    model sees them as one stream: after a recompute preemption the whole list
    is prefilled again, and ``num_computed_tokens`` says how much of it is
    already in the KV cache. Policies never see this object: they get
    :attr:`view`, which reads it and cannot change it.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...] | Prefix  # kept as a tuple (an array('i'): a Prefix), shared with the view
    params: SamplingParams
    priority: int = 0
    client_id: str = "default"
    arrival_time: float = field(default_factory=time.perf_counter)
    deadline_s: float | None = None  # seconds after arrival by which it should be done
    # Free-form JSON attributes for policies (read-only; validated by Engine.add_request).
    attrs: Mapping[str, Any] = field(default_factory=lambda: EMPTY_ATTRS, repr=False)
    # Part of every KV block hash: requests with different salts never share cached KV.
    cache_salt: str | None = None

    token_ids: list[int] = field(init=False)
    num_prompt_tokens: int = field(init=False)  # a plain int: read for every token (a Prefix's len is a call)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    error: str | None = None

    # Timestamps (scheduler clock seconds) for the metrics.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None

    generator: torch.Generator | None = field(default=None, repr=False)
    logprobs: list[dict[int, float]] = field(default_factory=list, repr=False)
    # Prefix caching. ``block_hashes`` names the full blocks of ``token_ids`` (filled lazily by the
    # block manager; token ids only grow, so a name never changes). ``num_cached_prompt_tokens``: of
    # the tokens this sequence must prefill (its prompt, plus its output after a recompute), how many
    # the cache held when last looked up. The two counters add up every admission's lookup.
    block_hashes: list[bytes] = field(default_factory=list, repr=False)
    num_cached_prompt_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # The queue key, stored at arrival when the queue's keys never change (the built-in fcfs and
    # priority without aging): the scheduler then sorts by it instead of asking the queue each step.
    queue_key: Any = field(default=None, repr=False)
    view: SeqView = field(init=False, repr=False)

    def __post_init__(self) -> None:
        ids = self.prompt_token_ids  # an array('i') becomes the token array, the prompt a view of its start
        self.prompt_token_ids = Prefix(ids, len(ids)) if isinstance(ids, array) else tuple(ids)
        self.token_ids = ids if isinstance(ids, array) else list(self.prompt_token_ids)
        self.num_prompt_tokens = len(ids)
        if self.params.seed is not None:
            import torch

            self.generator = torch.Generator(device="cpu").manual_seed(self.params.seed)
        self.view = SeqView(self)

    # The clock time (``arrival_time + deadline_s``) by which it should be done, or None.
    deadline = property(lambda self: None if self.deadline_s is None else self.arrival_time + self.deadline_s)

    num_tokens = property(lambda self: len(self.token_ids))
    num_output_tokens = property(lambda self: len(self.token_ids) - self.num_prompt_tokens)
    output_token_ids = property(lambda self: self.token_ids[self.num_prompt_tokens :])
    # Tokens whose KV is not yet computed (a whole prompt, a chunk's rest, or 1 when decoding).
    num_pending_tokens = property(lambda self: len(self.token_ids) - self.num_computed_tokens)
    is_prefilling = property(lambda self: len(self.token_ids) - self.num_computed_tokens > 1)
    is_finished = property(lambda self: self.status is SequenceStatus.FINISHED)

    def append_token(self, token_id: int, now: float) -> None:
        self.token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = now
        self.token_times.append(now)

    def finish(self, reason: FinishReason, now: float, error: str | None = None) -> None:
        self.status, self.finish_reason = SequenceStatus.FINISHED, reason
        self.finish_time, self.error = now, error


class Prefix(Seq[int]):
    """The first ``n`` ids of a growing token array: an array prompt held once, not copied."""

    __slots__ = ("_ids", "_n")

    def __init__(self, ids: Seq[int], n: int) -> None:
        self._ids, self._n = ids, n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index: Any) -> Any:  # one id without copying the prefix; a slice copies
        return self._ids[range(self._n)[index]] if isinstance(index, int) else self._ids[: self._n][index]

    def __iter__(self) -> Iterator[int]:
        return iter(self._ids[: self._n])


_GONE = {
    "policy_state": "keep per-request state on the policy itself, keyed by seq.request_id (and drop it in on_finish)",
    "token_ids": "read prompt_token_ids and output_token_ids (tuples)",
}


def _gone(name: str) -> NoReturn:
    raise AttributeError(f"a sequence view has no {name!r}: {_GONE[name]}")


class SeqView:
    """What a policy is handed for a sequence: every field reads the live sequence, none can be written.

    Counters are ints, containers are tuples (copies), ``attrs`` a read-only
    mapping and ``params`` a frozen model, so nothing a policy does with its
    arguments changes what the engine or another policy sees. One view per
    sequence, made with it: identity and ``==`` work as on the sequence, and a
    view kept after the request ended keeps reading its final state.
    Underscored attributes are the engine's, outside that promise (like the
    garbage collector or frames).
    """

    _COPIED = ("request_id", "priority", "client_id", "arrival_time", "deadline_s", "attrs", "params")
    __slots__ = ("_blocks", "_seq", "num_prompt_tokens", "prompt_token_ids", *_COPIED)

    def __init__(self, seq: Sequence, blocks: Any = None) -> None:
        put = object.__setattr__
        put(self, "_seq", seq)
        put(self, "_blocks", blocks)  # the block manager, for a waiting sequence's cached prefix
        for name in self._COPIED:  # fixed for the request's life
            put(self, name, getattr(seq, name))
        put(self, "prompt_token_ids", seq.prompt_token_ids)  # a tuple (or read-only Prefix) already: shared
        put(self, "num_prompt_tokens", seq.num_prompt_tokens)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"a policy cannot set {name!r}: sequences are read-only for policies; {_GONE['policy_state']}")

    __delattr__ = __setattr__  # type: ignore[assignment]

    # Names that left the view say what replaces them. Properties, not a __getattr__: a class with a
    # __getattr__ hook gets no specialised attribute reads, which every field read of a policy would pay.
    policy_state = property(lambda self: _gone("policy_state"))
    token_ids = property(lambda self: _gone("token_ids"))

    def __repr__(self) -> str:
        return f"SeqView({self.request_id!r})"

    deadline = property(lambda self: self._seq.deadline)
    num_computed_tokens = property(lambda self: self._seq.num_computed_tokens)
    num_preemptions = property(lambda self: self._seq.num_preemptions)
    num_tokens = property(lambda self: len(self._seq.token_ids))
    num_output_tokens = property(lambda self: self._seq.num_output_tokens)
    output_token_ids = property(lambda self: tuple(self._seq.output_token_ids))
    block_table = property(lambda self: tuple(self._seq.block_table))
    status = property(lambda self: self._seq.status.value)
    finish_reason = property(lambda self: self._seq.finish_reason)

    @property
    def num_cached_prompt_tokens(self) -> int:
        """Of the tokens it must prefill, how many the prefix cache holds: looked up now while it waits
        (a policy that never reads it costs nothing), as found at admission once it runs."""
        seq = self._seq
        if seq.status is SequenceStatus.WAITING and self._blocks is not None:
            return self._blocks.lookup(seq)
        return seq.num_cached_prompt_tokens

    num_pending_tokens = property(lambda self: len(self._seq.token_ids) - self._seq.num_computed_tokens)
    is_prefilling = property(lambda self: len(self._seq.token_ids) - self._seq.num_computed_tokens > 1)
