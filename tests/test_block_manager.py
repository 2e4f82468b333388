"""Paged KV bookkeeping under random allocate / append / free / preempt / swap sequences."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cbcore.scheduling.block_manager import BlockManager
from cbcore.scheduling.sampling_params import SamplingParams
from cbcore.scheduling.sequence import Sequence
from cbcore.testing.block_invariants import check_blocks

NUM_BLOCKS, BLOCK_SIZE, HOST_BLOCKS = 12, 4, 6


class BlockMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = BlockManager(NUM_BLOCKS, BLOCK_SIZE, HOST_BLOCKS)
        self.live: list[Sequence] = []  # holding device blocks
        self.swapped: list[Sequence] = []
        self.ids = 0

    def _new(self) -> Sequence:
        self.ids += 1
        return Sequence(request_id=f"r{self.ids}", prompt_token_ids=[1], params=SamplingParams())

    @rule(tokens=st.integers(1, 20))
    def allocate(self, tokens):
        seq = self._new()
        if self.blocks.can_grow(seq, tokens):
            self.blocks.grow(seq, tokens)
            seq.num_computed_tokens = tokens
            assert len(seq.block_table) == -(-tokens // BLOCK_SIZE)
            self.live.append(seq)
        else:
            with pytest.raises(MemoryError):
                self.blocks.grow(seq, tokens)
            assert seq.block_table == []

    @precondition(lambda self: self.live)
    @rule(data=st.data(), tokens=st.integers(1, 9))
    def append(self, data, tokens):
        seq = data.draw(st.sampled_from(self.live))
        before = len(seq.block_table)
        if self.blocks.can_grow(seq, tokens):
            self.blocks.grow(seq, tokens)
            seq.num_computed_tokens += tokens
            assert len(seq.block_table) * BLOCK_SIZE >= seq.num_computed_tokens
            assert len(seq.block_table) - before <= -(-tokens // BLOCK_SIZE)
        else:
            with pytest.raises(MemoryError):
                self.blocks.grow(seq, tokens)
            assert len(seq.block_table) == before

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(self.live))
        self.blocks.free(seq)
        self.live.remove(seq)
        assert seq.block_table == []

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def preempt_recompute(self, data):
        seq = data.draw(st.sampled_from(self.live))
        self.blocks.free(seq)
        seq.num_computed_tokens = 0
        self.live.remove(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def swap_out(self, data):
        seq = data.draw(st.sampled_from(self.live))
        if not self.blocks.can_swap_out(seq):
            return
        n = len(seq.block_table)
        pairs = self.blocks.swap_out(seq)
        assert len(pairs) == n and seq.block_table == []
        self.live.remove(seq)
        self.swapped.append(seq)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        seq = data.draw(st.sampled_from(self.swapped))
        if not self.blocks.can_swap_in(seq):
            return
        host = list(self.blocks.host_blocks_of(seq))
        pairs = self.blocks.swap_in(seq)
        assert [h for h, _ in pairs] == host
        assert [d for _, d in pairs] == seq.block_table
        self.swapped.remove(seq)
        self.live.append(seq)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def drop_swapped(self, data):
        seq = data.draw(st.sampled_from(self.swapped))
        self.blocks.drop_host(seq)
        self.swapped.remove(seq)

    @invariant()
    def no_block_owned_twice_or_leaked(self):
        check_blocks(self.blocks, self.live)
        used = sum(len(s.block_table) for s in self.live)
        assert self.blocks.num_used_blocks == used
        host_used = sum(len(self.blocks.host_blocks_of(s)) for s in self.swapped)
        assert self.blocks.num_free_host_blocks == HOST_BLOCKS - host_used

    def teardown(self):
        for seq in list(self.live):
            self.blocks.free(seq)
        for seq in list(self.swapped):
            self.blocks.drop_host(seq)
        assert self.blocks.num_free_blocks == NUM_BLOCKS
        assert self.blocks.num_free_host_blocks == HOST_BLOCKS


BlockMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestBlockManager = BlockMachine.TestCase


def test_free_rejects_a_block_it_does_not_reference():
    blocks = BlockManager(4, 4)
    a = Sequence(request_id="a", prompt_token_ids=[1], params=SamplingParams())
    b = Sequence(request_id="b", prompt_token_ids=[1], params=SamplingParams())
    blocks.grow(a, 4)
    b.block_table = list(a.block_table)
    blocks.free(a)
    with pytest.raises(RuntimeError, match="is not referenced"):
        blocks.free(b)


def test_check_detects_a_block_in_two_tables_with_one_reference():
    blocks = BlockManager(4, 4)
    a = Sequence(request_id="a", prompt_token_ids=[1], params=SamplingParams())
    b = Sequence(request_id="b", prompt_token_ids=[1], params=SamplingParams())
    blocks.grow(a, 4)
    b.block_table = list(a.block_table)
    with pytest.raises(AssertionError, match="in 2 block tables but its reference count is 1"):
        check_blocks(blocks, [a, b])


def test_needing_a_block_agrees_with_blocks_needed():
    blocks = BlockManager(64, 4)
    seqs = []
    for computed in range(0, 13):
        seq = Sequence(request_id=f"s{computed}", prompt_token_ids=[1] * 13, params=SamplingParams())
        blocks.grow(seq, computed)
        seq.num_computed_tokens = computed
        seqs.append(seq)
    needy = blocks.needing_a_block(seqs)
    assert needy == [s for s in seqs if blocks.blocks_needed(s, 1) > 0]
    assert [s.num_computed_tokens for s in needy] == [0, 4, 8, 12]
    blocks.try_grow(seqs[4], 1)
    assert seqs[4] not in blocks.needing_a_block(seqs)
