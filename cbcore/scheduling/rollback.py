"""Undoing a step that failed half-way, so the engine is as it was before it.

A step changes sequences (status, computed tokens, block tables, preemption
counts, finish fields) and the block manager before anything is known to be
right: a policy may raise in the middle of ``schedule()``, the plan check may
refuse the result, an ``on_step_end`` handler may raise after tokens were
appended. :class:`SeqUndo` captures, before the step, what it may change of
the sequences that hold state (running and swapped ones) and what a waiting
sequence must look like (no blocks, nothing computed); the block manager is
then rebuilt from the restored block tables, so capturing costs nothing per
block. Policies' own state is theirs: they see no event that a step was undone.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from cbcore.scheduling.block_manager import BlockManager
from cbcore.scheduling.plan import StepPlan
from cbcore.scheduling.sequence import Sequence, SequenceStatus


class SeqUndo:
    """Sequence state before a step: full fields of ``held`` ones, the waiting state for ``idle`` ones."""

    __slots__ = ("blocks", "held", "idle", "since")

    def __init__(self, held: Iterable[Sequence], idle: Iterable[Sequence], blocks: BlockManager, since: float):
        self.held = [(s, s.status, s.num_computed_tokens, s.num_preemptions, s.block_table, len(s.block_table)) for s in held]
        self.idle = list(idle)
        self.blocks = blocks.undo_point()
        self.since = since

    def restore(self, blocks: BlockManager) -> None:
        live: list[Sequence] = []
        for seq, status, computed, preemptions, table, n in self.held:
            del table[n:]
            seq.status, seq.num_computed_tokens, seq.num_preemptions, seq.block_table = status, computed, preemptions, table
            _unfinish(seq)
            live.append(seq)
        for seq in self.idle:
            seq.status = SequenceStatus.WAITING
            seq.num_computed_tokens = 0
            seq.block_table = []
            if seq.first_scheduled_time is not None and seq.first_scheduled_time >= self.since:
                seq.first_scheduled_time = None  # first admitted by the step being undone
            _unfinish(seq)
        blocks.reset_to(live, self.blocks)


def _unfinish(seq: Sequence) -> None:
    seq.finish_reason = None
    seq.finish_time = None
    seq.error = None


class TokenUndo:
    """The tokens a step appended (one per sampling sequence) and the RNG states it consumed."""

    __slots__ = ("appended", "rng")

    def __init__(self) -> None:
        self.appended: list[tuple[Sequence, bool]] = []  # (seq, whether it had a first token before)
        self.rng: list[tuple[Any, Any]] = []  # (generator, state before sampling)

    def save_rng(self, plan: StepPlan) -> None:
        """The states of the generators this step's sampling will consume (rows that sample carry theirs)."""
        self.rng = [(row.generator, row.generator.get_state()) for row in plan.rows if row.generator is not None]

    def restore(self) -> None:
        for seq, had_first in reversed(self.appended):
            seq.token_ids.pop()
            seq.token_times.pop()
            if len(seq.logprobs) > seq.num_output_tokens:
                seq.logprobs.pop()
            if not had_first:
                seq.first_token_time = None
        for generator, state in self.rng:
            generator.set_state(state)
