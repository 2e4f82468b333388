"""The block manager's construction: what it refuses, and that it caches prefixes only when asked."""

from __future__ import annotations

import pytest

from cbcore.scheduling.block_manager import BlockManager, extend_hashes
from cbcore.scheduling.sampling_params import SamplingParams
from cbcore.scheduling.sequence import Sequence


@pytest.mark.parametrize(("num_blocks", "block_size"), [(0, 4), (4, 0), (-1, 4)])
def test_no_blocks_or_empty_blocks_are_refused(num_blocks: int, block_size: int) -> None:
    with pytest.raises(ValueError, match="need num_blocks >= 1 and block_size >= 1"):
        BlockManager(num_blocks, block_size)
    BlockManager(1, 1)  # the smallest there is


def test_without_prefix_caching_a_finished_prompt_leaves_nothing_to_find() -> None:
    blocks = BlockManager(8, 4)
    first = Sequence("first", list(range(9)), SamplingParams())
    blocks.grow(first, 9)
    first.num_computed_tokens = 9
    blocks.register_computed([first])
    blocks.free(first)
    assert blocks.num_cached_blocks == 0 and blocks.num_free_blocks == 8
    again = Sequence("again", list(range(9)), SamplingParams())
    assert blocks.lookup(again) == 0 and blocks.acquire_cached(again) == 0 and again.block_table == []


def test_swapping_in_needs_room_for_the_new_tokens_as_well_as_the_host_copy() -> None:
    blocks = BlockManager(5, 4, num_host_blocks=4)
    seq = Sequence("s", list(range(8)), SamplingParams())
    blocks.grow(seq, 8)
    seq.num_computed_tokens = 8
    blocks.swap_out(seq)  # 2 host blocks
    filler = Sequence("filler", [1] * 8, SamplingParams())
    blocks.grow(filler, 8)  # 3 device blocks left free
    assert blocks.num_free_blocks == 3
    assert blocks.can_swap_in(seq) and blocks.can_swap_in(seq, 4)  # 12 tokens: 3 blocks
    assert not blocks.can_swap_in(seq, 5)  # 13 tokens: 4 blocks


def test_a_prompt_is_hashed_by_its_full_blocks_only() -> None:
    hashes: list = []
    extend_hashes(hashes, list(range(9)), 4, None, upto=10)
    assert len(hashes) == 2
    extend_hashes(hashes, list(range(9)), 4, None, upto=10)  # nothing new: nothing added
    assert len(hashes) == 2


def test_a_table_that_already_covers_the_new_tokens_needs_no_block() -> None:
    blocks = BlockManager(8, 4)
    seq = Sequence("s", list(range(12)), SamplingParams())
    blocks.grow(seq, 12)  # 3 blocks
    assert blocks.blocks_needed(seq, 4) == 0 and blocks.blocks_needed(seq, 13) == 1


def test_with_prefix_caching_a_finished_prompts_full_blocks_are_found_from_the_first() -> None:
    blocks = BlockManager(8, 4, prefix_caching=True)
    first = Sequence("first", list(range(9)), SamplingParams())
    blocks.grow(first, 9)
    first.num_computed_tokens = 9
    blocks.register_computed([first])
    blocks.free(first)
    assert blocks.lookup(Sequence("again", list(range(9)), SamplingParams())) == 8


def test_an_undo_keeps_every_free_host_block() -> None:
    blocks = BlockManager(4, 4, num_host_blocks=3)
    point = blocks.undo_point()
    seq = Sequence("s", list(range(4)), SamplingParams())
    blocks.grow(seq, 4)
    seq.num_computed_tokens = 4
    blocks.swap_out(seq)
    blocks.reset_to([], point)
    assert blocks.num_free_host_blocks == 3 and blocks.num_free_blocks == 4


def test_a_swap_out_that_fills_the_host_pool_exactly_fits_and_one_block_more_does_not() -> None:
    blocks = BlockManager(8, 4, num_host_blocks=2)
    fits, too_big = Sequence("fits", list(range(8)), SamplingParams()), Sequence("big", list(range(9)), SamplingParams())
    blocks.grow(fits, 8)  # 2 blocks: the whole host pool
    blocks.grow(too_big, 9)  # 3 blocks
    assert blocks.can_swap_out(fits) and not blocks.can_swap_out(too_big)
    assert len(blocks.swap_out(fits)) == 2 and blocks.num_free_host_blocks == 0


def test_an_admissions_lookup_is_counted_only_with_prefix_caching() -> None:
    for caching in (False, True):
        blocks = BlockManager(8, 4, prefix_caching=caching)
        assert blocks.prefix_cache_queries_tokens == blocks.prefix_cache_hits_tokens == 0
        first = Sequence("first", list(range(9)), SamplingParams())
        blocks.record_lookup(first, blocks.acquire_cached(first))
        blocks.grow(first, 9)
        first.num_computed_tokens = 9
        blocks.register_computed([first])
        again = Sequence("again", list(range(9)), SamplingParams())
        blocks.record_lookup(again, blocks.acquire_cached(again))
        counted = (blocks.prefix_cache_queries_tokens, blocks.prefix_cache_hits_tokens, again.prefix_cache_hits)
        assert counted == ((18, 8, 8) if caching else (0, 0, 0)), (caching, counted)
