"""The four scheduling extension points and the events policies receive.

A policy is a small class with a ``name``, a ``kind`` and a pydantic
``Params`` model. The composed scheduler (:mod:`cbcore.scheduling.policy_scheduler`) asks
each kind one narrow question per step:

* ``queue``      — in what order should waiting (and running) sequences be served?
* ``budget``     — how many sequences / tokens may this step carry; may this one join?
* ``prefill``    — how many of a sequence's pending prompt tokens run this step?
* ``preemption`` — when the KV cache cannot grow, whom to evict and how?

Policies see sequences through :class:`SequenceView` (read them, do not mutate
them; keep your own state in ``seq.policy_state`` or on the policy) and the
KV bookkeeping through :class:`KVView`.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol

from pydantic import BaseModel

from cbcore.plugins import NoParams


class SequenceView(Protocol):
    """What a policy may read about a sequence (docs/policies.md describes every field)."""

    request_id: str
    priority: int  # the ``priority`` queue serves smaller values first
    client_id: str
    arrival_time: float  # scheduler clock seconds
    deadline_s: float | None  # seconds after arrival by which it should be done, or None
    attrs: Mapping[str, Any]  # the request's free-form JSON attributes, read-only
    num_computed_tokens: int
    # Tokens of its pending prefill the prefix cache held when last looked up: at admission, and
    # every step for a queue whose reads_cached_prefix() says so. Admission skips them.
    num_cached_prompt_tokens: int
    num_preemptions: int
    block_table: list[int]
    policy_state: dict[str, object]

    @property
    def deadline(self) -> float | None: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def num_output_tokens(self) -> int: ...
    @property
    def num_pending_tokens(self) -> int: ...
    @property
    def is_prefilling(self) -> bool: ...

    params: Any  # SamplingParams


class KVView(Protocol):
    """What a policy may read about the KV cache."""

    num_blocks: int
    block_size: int

    @property
    def num_free_blocks(self) -> int: ...
    @property
    def num_used_blocks(self) -> int: ...
    def blocks_needed(self, seq: Any, num_new_tokens: int) -> int: ...


@dataclass(frozen=True)
class SchedulerState:
    """A read-only snapshot handed to budget policies at the start of a step."""

    now: float
    step: int
    waiting: Seq[SequenceView]  # in the queue policy's order: the order admissions are tried
    running: Seq[SequenceView]
    swapped: Seq[SequenceView]
    kv: KVView


@dataclass(frozen=True)
class StepLimits:
    max_num_seqs: int
    max_num_tokens: int


@dataclass(frozen=True)
class StepResult:
    """What one scheduled sequence did in a step (sent to ``on_step_end``)."""

    seq: SequenceView
    num_computed: int  # tokens whose KV was computed this step
    new_token: int | None  # the sampled token, None for a non-final prefill chunk


class Policy:
    """Base of every policy: identity, params and no-op event handlers."""

    name: ClassVar[str]
    kind: ClassVar[str]
    Params: ClassVar[type[BaseModel]] = NoParams

    def __init__(self, params: BaseModel | None = None) -> None:
        self.params = params if params is not None else self.Params()

    # Events. ``now`` is the scheduler clock (seconds).
    def on_arrival(self, seq: SequenceView, now: float) -> None: ...
    def on_step_end(self, results: Seq[StepResult], now: float) -> None: ...
    def on_finish(self, seq: SequenceView, now: float) -> None: ...
    def on_preempt(self, seq: SequenceView, now: float) -> None: ...


class QueuePolicy(Policy):
    """Orders sequences; the first in order is served first and evicted last."""

    kind: ClassVar[str] = "queue"
    #: When True, a waiting sequence that finds no free slot or KV blocks may
    #: preempt running sequences the queue ranks strictly below it (only when
    #: evicting them can make room).
    preempts_running: bool = False
    #: When True, ``key(seq, now)`` never changes once ``seq`` has arrived (it
    #: depends on neither ``now`` nor what was served). The scheduler then
    #: computes each key once, at arrival, and sorts by the stored keys instead
    #: of calling :meth:`order`: ordering a thousand waiting requests every step
    #: would otherwise cost more than the rest of the step.
    fixed_keys: bool = False

    def reads_cached_prefix(self, num_waiting: int) -> bool:
        """Whether :meth:`order` reads ``num_cached_prompt_tokens`` with this many waiting.

        When True (and prefix caching is on) the scheduler looks every waiting
        sequence up in the cache before ordering them; the lookup costs a few
        dictionary probes per sequence, so a policy may decline on long queues.
        """
        return False

    def key(self, seq: SequenceView, now: float) -> Any:
        """Sort key; smaller is served first. Override this or :meth:`order`."""
        raise NotImplementedError

    def order(self, seqs: Seq[SequenceView], now: float) -> list[SequenceView]:
        return sorted(seqs, key=lambda s: self.key(s, now))

    def outranks(self, a: SequenceView, b: SequenceView, now: float) -> bool:
        """True when ``a`` should be served strictly before ``b``."""
        return bool(self.key(a, now) < self.key(b, now))


class BudgetPolicy(Policy):
    """Caps what one step carries and decides admission of waiting sequences."""

    kind: ClassVar[str] = "budget"

    def limits(self, state: SchedulerState) -> StepLimits:
        raise NotImplementedError

    def may_admit(self, seq: SequenceView, state: SchedulerState) -> bool:
        return True


class PrefillPolicy(Policy):
    """Sizes prefill work: whole prompts or chunks, and decode-first or prefill-first."""

    kind: ClassVar[str] = "prefill"
    order: Literal["decode-first", "prefill-first"] = "decode-first"

    def begin_step(self) -> None:
        """Called once per step before any :meth:`num_tokens` call."""

    def num_tokens(self, seq: SequenceView, tokens_left: int, batch_empty: bool) -> int:
        """Pending tokens of ``seq`` to run now (0: not this step).

        ``tokens_left`` is what remains of the step's token budget and
        ``batch_empty`` says nothing else is scheduled yet.
        """
        raise NotImplementedError


class PreemptionPolicy(Policy):
    """Picks a victim when the KV cache cannot grow, and says how to evict it.

    The candidates are the running sequences not yet scheduled this step. The
    running phase serves sequences in the queue policy's order, so the queue's
    order decides who *can* be evicted (those it ranks last) and this policy
    which of them is.
    """

    kind: ClassVar[str] = "preemption"
    mode: Literal["recompute", "swap"] = "recompute"

    def choose_victim(self, candidates: Seq[SequenceView], queue: QueuePolicy, now: float) -> SequenceView:
        raise NotImplementedError

