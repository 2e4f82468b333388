"""Prefix caching in the block manager under random allocate / share / append / free / preempt / swap / evict.

A shadow KV pool records what each device (and host) slot holds: the whole
token prefix up to that position, which is what the KV there depends on. After
every rule: each live sequence reads exactly its own prefix at every computed
position (so no block it references was reused or overwritten), every
registered block holds exactly the prefix its hash names, reference counts
match the tables (``BlockManager.check``), and nothing leaks.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cbcore.scheduling.block_manager import BlockManager
from cbcore.scheduling.sampling_params import SamplingParams
from cbcore.scheduling.sequence import Sequence
from cbcore.testing.block_invariants import chain_hashes, check_blocks

NUM_BLOCKS, BLOCK_SIZE, HOST_BLOCKS = 16, 4, 8
# Prompts drawn from a couple of stems over a tiny alphabet, so prefixes are shared often.
STEMS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3], [7, 7, 7, 7, 2, 2, 2, 2, 5, 5, 5, 5]]


class PrefixMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = BlockManager(NUM_BLOCKS, BLOCK_SIZE, HOST_BLOCKS, prefix_caching=True)
        self.device: dict[int, dict[int, tuple[int, ...]]] = {}  # block -> slot -> prefix whose KV it holds
        self.host: dict[int, dict[int, tuple[int, ...]]] = {}
        self.live: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.ids = 0
        self.hits = 0

    # -- helpers -------------------------------------------------------------

    def _compute(self, seq: Sequence, n: int) -> bool:
        """Grow ``seq`` by ``n`` tokens, 'write' their KV, and register full blocks (as a step would)."""
        n = min(n, seq.num_pending_tokens)
        if n <= 0 or not self.blocks.try_grow(seq, n):
            return False
        for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            block = seq.block_table[p // BLOCK_SIZE]
            assert self.blocks.ref_count(block) == 1, "a shared block is being written"
            self.device.setdefault(block, {})[p % BLOCK_SIZE] = tuple(seq.token_ids[: p + 1])
        seq.num_computed_tokens += n
        self.blocks.register_computed([seq])
        return True

    def _admit(self, tokens: list[int], salt: str | None, n: int) -> None:
        self.ids += 1
        seq = Sequence(
            request_id=f"r{self.ids}", prompt_token_ids=tokens, params=SamplingParams(), cache_salt=salt
        )
        expected = self.blocks.lookup(seq)
        hit = self.blocks.acquire_cached(seq)
        assert hit == expected and hit <= len(tokens) - 1 and hit % BLOCK_SIZE == 0
        self.hits += hit
        if self._compute(seq, max(1, n)):
            self.blocks.record_lookup(seq, hit)
            self.live.append(seq)
        else:  # not admitted: give the cached blocks back
            self.blocks.free(seq)
            seq.num_computed_tokens = 0

    # -- rules ---------------------------------------------------------------

    @rule(
        stem=st.sampled_from(STEMS),
        cut=st.integers(0, 12),
        tail=st.lists(st.integers(1, 3), max_size=6),
        salt=st.sampled_from([None, None, "tenant-b"]),
        n=st.integers(1, 24),
    )
    def allocate(self, stem, cut, tail, salt, n):
        tokens = stem[:cut] + tail
        if tokens:
            self._admit(tokens, salt, n)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), extra=st.lists(st.integers(1, 3), max_size=5), n=st.integers(1, 24))
    def share(self, data, extra, n):
        """A new request whose prompt extends a live one's tokens (the next turn of a chat)."""
        seq = data.draw(st.sampled_from(self.live))
        self._admit(list(seq.token_ids) + extra, seq.cache_salt, n)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), n=st.integers(1, 9), token=st.integers(1, 3))
    def append(self, data, n, token):
        seq = data.draw(st.sampled_from(self.live))
        if seq.num_pending_tokens == 0:
            seq.append_token(token, 0.0)  # a decoded token, fed back next step
        self._compute(seq, n)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(self.live))
        self.blocks.free(seq)
        self.live.remove(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), n=st.integers(1, 24))
    def preempt_recompute(self, data, n):
        """Drop the KV and prefill again: the sequence should find its own blocks if they survived."""
        seq = data.draw(st.sampled_from(self.live))
        computed = seq.num_computed_tokens
        self.blocks.free(seq)
        self.live.remove(seq)
        seq.num_computed_tokens = 0
        hit = self.blocks.acquire_cached(seq)
        assert hit <= max(computed, seq.num_tokens - 1)
        if self._compute(seq, max(1, n)):
            self.live.append(seq)
        else:
            self.blocks.free(seq)
            seq.num_computed_tokens = 0

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def swap_out(self, data):
        seq = data.draw(st.sampled_from(self.live))
        if not self.blocks.can_swap_out(seq):
            return
        for device, host in self.blocks.swap_out(seq):  # copy on swap: the device block is left as it was
            self.host[host] = dict(self.device.get(device, {}))
        self.live.remove(seq)
        self.swapped.append(seq)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        seq = data.draw(st.sampled_from(self.swapped))
        if not self.blocks.can_swap_in(seq):
            return
        for host, device in self.blocks.swap_in(seq):
            assert self.blocks.ref_count(device) == 1
            self.device[device] = dict(self.host.pop(host))
        self.swapped.remove(seq)
        self.live.append(seq)
        self.blocks.register_computed([seq])

    @rule()
    def evict_all_cached(self):
        freed_before = self.blocks.num_free_blocks
        self.blocks.reset_prefix_cache()
        assert self.blocks.num_free_blocks == freed_before
        assert self.blocks.num_cached_blocks == sum(
            1 for b in {b for s in self.live for b in s.block_table} if self.blocks._hash_of[b] is not None
        )

    # -- invariants ----------------------------------------------------------

    @invariant()
    def books_balance(self):
        check_blocks(self.blocks, self.live)
        assert self.blocks.num_used_blocks == len({b for s in self.live for b in s.block_table})

    @invariant()
    def every_sequence_reads_its_own_prefix(self):
        for seq in self.live:
            for p in range(seq.num_computed_tokens):
                block = seq.block_table[p // BLOCK_SIZE]
                assert self.device[block][p % BLOCK_SIZE] == tuple(seq.token_ids[: p + 1]), (
                    seq.request_id,
                    p,
                )

    @invariant()
    def every_registered_block_holds_its_prefix(self):
        for h, block in self.blocks._by_hash.items():
            slots = self.device[block]
            prefix = slots[BLOCK_SIZE - 1]
            assert [slots[i] for i in range(BLOCK_SIZE)] == [
                prefix[: len(prefix) - BLOCK_SIZE + i + 1] for i in range(BLOCK_SIZE)
            ]
            salted = [chain_hashes(list(prefix), BLOCK_SIZE, salt)[-1] for salt in (None, "tenant-b")]
            assert h in salted

    def teardown(self):
        for seq in list(self.live):
            self.blocks.free(seq)
        for seq in list(self.swapped):
            self.blocks.drop_host(seq)
        check_blocks(self.blocks, [])
        assert self.blocks.num_free_blocks == NUM_BLOCKS
        assert self.blocks.num_free_host_blocks == HOST_BLOCKS


PrefixMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
TestPrefixCache = PrefixMachine.TestCase


def _seq(rid: str, tokens: list[int], salt: str | None = None) -> Sequence:
    return Sequence(request_id=rid, prompt_token_ids=tokens, params=SamplingParams(), cache_salt=salt)


def _computed(blocks: BlockManager, seq: Sequence) -> Sequence:
    blocks.acquire_cached(seq)
    blocks.grow(seq, seq.num_pending_tokens)
    seq.num_computed_tokens = seq.num_tokens
    blocks.register_computed([seq])
    return seq


def test_a_hit_shares_full_blocks_and_always_leaves_the_last_token():
    blocks = BlockManager(8, 4, prefix_caching=True)
    a = _computed(blocks, _seq("a", list(range(1, 9))))  # two full blocks
    b = _seq("b", list(range(1, 9)))
    assert blocks.acquire_cached(b) == 4  # the whole prompt is cached, but its last token must run
    assert b.block_table == a.block_table[:1] and blocks.ref_count(a.block_table[0]) == 2
    check_blocks(blocks, [a, b])


def test_salts_isolate_and_freed_blocks_stay_findable_until_evicted():
    blocks = BlockManager(4, 4, prefix_caching=True)
    a = _computed(blocks, _seq("a", list(range(1, 10))))
    blocks.free(a)
    assert blocks.num_free_blocks == 4 and blocks.num_cached_blocks == 2
    assert blocks.lookup(_seq("x", list(range(1, 10)), salt="other")) == 0
    assert blocks.lookup(_seq("y", list(range(1, 10)))) == 8
    hog = _seq("hog", [9] * 13)
    blocks.grow(hog, 13)  # needs all four blocks: both cached ones are evicted
    assert blocks.num_cached_blocks == 0 and blocks.lookup(_seq("z", list(range(1, 10)))) == 0
    check_blocks(blocks, [hog])


def test_evictable_blocks_go_least_recently_used_first_and_tail_first():
    blocks = BlockManager(6, 2, prefix_caching=True)
    old = _computed(blocks, _seq("old", [1, 2, 3, 4, 5]))
    new = _computed(blocks, _seq("new", [6, 7, 8, 9, 5]))
    blocks.free(old)
    blocks.free(new)
    taker = _seq("t", [0] * 3)
    blocks.grow(taker, 3)  # two blocks: the two free uncached ones
    taker.num_computed_tokens = 3
    assert blocks.num_cached_blocks == 4
    blocks.grow(taker, 2)  # one more: the tail of the least recently freed prefix goes first
    assert blocks.lookup(_seq("o", [1, 2, 3, 4, 0])) == 2 and blocks.lookup(_seq("n", [6, 7, 8, 9, 0])) == 4


def test_num_freed_by_counts_only_blocks_nobody_else_holds():
    blocks = BlockManager(8, 4, prefix_caching=True)
    a = _computed(blocks, _seq("a", list(range(1, 11))))
    b = _seq("b", [*list(range(1, 9)), 42, 43])
    blocks.acquire_cached(b)
    blocks.grow(b, b.num_pending_tokens)
    assert blocks.num_freed_by([b]) == 1  # its own tail; the two shared blocks stay with a
    assert blocks.num_freed_by([a, b]) == len(set(a.block_table) | set(b.block_table))
