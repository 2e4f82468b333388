"""The four scheduling extension points: what a policy author writes.

A policy is a small class with a ``name`` and, if it takes parameters, a
pydantic ``Params`` model. The scheduler (:mod:`cbcore.scheduling.policy_scheduler`,
whose docstring is the scheduling specification) asks each kind narrow
questions every step:

* ``queue``      — ``key`` (or ``order``): in what order are sequences served
                   (the last is evicted first)? ``outranks``: may a waiting
                   sequence evict a running one?
* ``budget``     — ``limits``: how many sequences / tokens may this step
                   carry? ``may_admit``: may this waiting sequence join?
* ``prefill``    — ``num_tokens``: how many of a sequence's pending tokens run now?
* ``preemption`` — ``choose_victim``: whom to evict when the KV cache cannot
                   grow; a ``mode`` parameter (recompute or swap) says how.

**Answers are free of side effects.** The scheduler may ask a question
again, or plan a step again without a request whose policy call failed, so
an answer must depend only on its arguments and on state the policy changed
in its events. State changes happen in the events: ``on_arrival``,
``on_step_end`` (what every scheduled sequence computed and sampled, and who
was preempted, delivered once the step has committed) and ``on_finish``.

Policies see sequences as read-only views (:class:`SequenceView`) and the KV
cache through ``state.kv``: nothing a policy does with its arguments changes
the engine. Every call goes through one door (:mod:`cbcore.scheduling.door`)
that checks the answer and names the policy, the method and the request when
it is wrong or raises.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Protocol

from pydantic import BaseModel

from cbcore.plugins import NoParams

__all__ = [
    "BudgetPolicy", "PreemptionPolicy", "PrefillPolicy", "QueuePolicy", "SchedulerState", "SequenceView",
    "StepLimits", "StepResult",
]  # fmt: skip


class SequenceView(Protocol):
    """What a policy may read about a sequence (docs/policies.md describes every field); nothing is writable."""

    request_id: str
    priority: int  # the ``priority`` queue serves smaller values first
    client_id: str
    arrival_time: float  # scheduler clock seconds
    deadline_s: float | None  # seconds after arrival by which it should be done, or None
    attrs: Mapping[str, Any]  # the request's free-form JSON attributes, read-only
    params: Any  # its SamplingParams (frozen)
    prompt_token_ids: tuple[int, ...]
    num_prompt_tokens: int

    @property
    def deadline(self) -> float | None: ...
    @property
    def num_computed_tokens(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def num_output_tokens(self) -> int: ...
    @property
    def output_token_ids(self) -> tuple[int, ...]: ...
    @property
    def num_pending_tokens(self) -> int: ...
    @property
    def is_prefilling(self) -> bool: ...
    @property
    def num_preemptions(self) -> int: ...
    @property
    def num_cached_prompt_tokens(self) -> int: ...
    @property
    def block_table(self) -> tuple[int, ...]: ...


class LazyViews(Seq[Any]):
    """The waiting queue's views in queue order, ordered on first read: most steps never read it."""

    __slots__ = ("_items", "_order")

    def __init__(self, order: Callable[[], list[Any]]) -> None:  # the sequences, each with a .view
        object.__setattr__(self, "_order", order)
        object.__setattr__(self, "_items", None)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"state.waiting is read-only (tried to set {name!r})")

    __delattr__ = __setattr__

    @property
    def items(self) -> tuple[Any, ...]:
        if self._items is None:
            object.__setattr__(self, "_items", tuple(s.view for s in self._order()))
        return self._items

    def __getitem__(self, index: Any) -> Any:
        return self.items[index]

    def __len__(self) -> int:
        return len(self.items)


@dataclass(frozen=True)
class SchedulerState:
    """A read-only snapshot handed to budget policies at the start of a step."""

    now: float
    step: int
    waiting: Seq[SequenceView]  # in the queue policy's order: the order admissions are tried
    running: Seq[SequenceView]
    swapped: Seq[SequenceView]
    kv: Any  # KVView: num_blocks, block_size, num_free_blocks, num_used_blocks, blocks_needed(seq, n)


@dataclass(frozen=True)
class StepLimits:
    max_num_seqs: int
    max_num_tokens: int


class StepResult(NamedTuple):
    """What one sequence did in a step (sent to ``on_step_end``; a named tuple, read-only and quick to build)."""

    seq: SequenceView
    num_computed: int  # tokens whose KV was computed this step
    new_token: int | None  # the sampled token, None for a non-final prefill chunk (or a preemption)
    preempted: bool = False  # evicted this step (its computed tokens are dropped unless swapped)


class _Policy:
    """Identity, params and no-op events; subclass one of the four kinds below, not this."""

    name: ClassVar[str]
    kind: ClassVar[str]
    Params: ClassVar[type[BaseModel]] = NoParams

    def __init__(self, params: BaseModel | None = None) -> None:
        self.params = params if params is not None else self.Params()

    # Events, delivered after the step they concern has committed. ``now`` is the scheduler clock (seconds).
    def on_arrival(self, seq: SequenceView, now: float) -> None: ...
    def on_step_end(self, results: Seq[StepResult], now: float) -> None: ...
    def on_finish(self, seq: SequenceView, now: float) -> None: ...


class QueuePolicy(_Policy):
    """Orders sequences; the first in order is served first and evicted last."""

    kind: ClassVar[str] = "queue"
    #: Built-ins whose key never changes after arrival set this: the key is stored then. Not for plugins.
    _fixed_keys: ClassVar[bool] = False

    def key(self, seq: SequenceView, now: float) -> Any:
        """Sort key; smaller is served first. Override this or :meth:`order`."""
        raise NotImplementedError

    def order(self, seqs: Seq[SequenceView], now: float) -> list[SequenceView]:
        """Every given sequence once, first served first (override for an order no key expresses)."""
        return sorted(seqs, key=lambda s: self.key(s, now))

    def outranks(self, a: SequenceView, b: SequenceView, now: float) -> bool:
        """Whether waiting ``a``, finding no free slot or KV blocks, may evict running ``b``.

        False by default: admission waits for room. A preemptive ranking (priority,
        MLFQ) answers True when ``a`` ranks strictly above ``b``; the scheduler
        evicts only when evicting every such ``b`` would make room for ``a``.
        """
        return False


class BudgetPolicy(_Policy):
    """Caps what one step carries and decides admission of waiting sequences."""

    kind: ClassVar[str] = "budget"

    def limits(self, state: SchedulerState) -> StepLimits:
        raise NotImplementedError

    def may_admit(self, seq: SequenceView, state: SchedulerState) -> bool:
        return True


class PrefillPolicy(_Policy):
    """Sizes prefill work: whole prompts or chunks."""

    kind: ClassVar[str] = "prefill"

    def num_tokens(self, seq: SequenceView, tokens_left: int, scheduled: Seq[SequenceView]) -> int:
        """Pending tokens of ``seq`` to run now (0: not this step; more than pending: all of it).

        ``tokens_left`` is what remains of the step's token budget; ``scheduled``
        the sequences this step already holds (empty: ``seq`` would run alone, and
        then it may exceed ``tokens_left``). Asked only for sequences with more
        than one pending token: a decode always runs its one.
        """
        raise NotImplementedError


class PreemptionPolicy(_Policy):
    """Picks a victim when the KV cache cannot grow.

    How the victim is evicted is configuration, not code: a ``mode`` field in
    the policy's ``Params`` (``"recompute"``, the default when there is none,
    or ``"swap"``), as the built-in ``recompute`` and ``swap`` have.

    The candidates are the running sequences not yet scheduled this step. The
    running phase serves sequences in the queue policy's order, so the queue's
    order decides who *can* be evicted (those it ranks last) and this policy
    which of them is.
    """

    kind: ClassVar[str] = "preemption"

    def choose_victim(self, candidates: Seq[SequenceView], queue: QueuePolicy, now: float) -> SequenceView:
        raise NotImplementedError
