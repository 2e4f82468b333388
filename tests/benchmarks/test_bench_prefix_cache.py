"""Cost of a prefix-cache lookup: hashing a 4,096-token prompt's blocks and matching them.

``pytest tests/benchmarks/test_bench_prefix_cache.py --benchmark-enable`` times
it; without ``--benchmark-enable`` each case runs once as a plain test. A fresh
sequence is built for every round so its block hashes are computed, not read
back from the previous round: this is what admitting a new request costs.
Blocks of 16 tokens: 256 hashes per prompt.
"""

from __future__ import annotations

import pytest

from cbcore.scheduling.block_manager import BlockManager
from cbcore.scheduling.sampling_params import SamplingParams
from cbcore.scheduling.sequence import Sequence
from cbcore.testing.block_invariants import check_blocks

PROMPT_LEN, BLOCK_SIZE = 4096, 16
PROMPT = [3 + (i * 7919) % 49_000 for i in range(PROMPT_LEN)]


def seq(tokens: list[int]) -> Sequence:
    return Sequence("probe", tokens, SamplingParams())


def cached_manager() -> BlockManager:
    blocks = BlockManager(2 * PROMPT_LEN // BLOCK_SIZE, BLOCK_SIZE, prefix_caching=True)
    owner = Sequence("owner", PROMPT, SamplingParams())
    blocks.grow(owner, PROMPT_LEN)
    owner.num_computed_tokens = PROMPT_LEN
    blocks.register_computed([owner])
    blocks.free(owner)  # every block evictable, still findable
    return blocks


@pytest.mark.parametrize("case", ["hit", "miss"])
def test_hash_and_match_a_4k_prompt(benchmark, case: str) -> None:
    blocks = cached_manager()
    tokens = PROMPT if case == "hit" else [t + 1 for t in PROMPT]
    found = benchmark.pedantic(lambda s: blocks.lookup(s), setup=lambda: ((seq(tokens),), {}), rounds=200)
    assert found == (PROMPT_LEN - BLOCK_SIZE if case == "hit" else 0)


def test_hash_match_and_map_a_4k_prompt(benchmark) -> None:
    """The admission path: look up and map the cached blocks into a new block table (then undo)."""
    blocks = cached_manager()

    def acquire(s: Sequence) -> int:
        hit = blocks.acquire_cached(s)
        blocks.free(s)
        return hit

    hit = benchmark.pedantic(acquire, setup=lambda: ((seq(PROMPT),), {}), rounds=200)
    assert hit == PROMPT_LEN - BLOCK_SIZE
    check_blocks(blocks, [])
