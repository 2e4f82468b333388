"""Cost of packing one step (``build_flat_batch``) and of KV block allocate / free.

``pytest tests/benchmarks/test_bench_packing.py --benchmark-enable`` times
them; without ``--benchmark-enable`` (the default addopts) each case runs once
as a plain test. No model: packing is index arithmetic over block tables, and
the block manager is pure bookkeeping.

Packing layouts (block size 16):

* ``decode-256``: 256 decodes with 64..575 tokens of context;
* ``mixed``: 248 decodes plus 8 prompt chunks of 256 tokens;
* ``prefill-16``: 16 fresh prompts of 512 tokens;
* ``decode-256+kv_slots``: the decode layout plus the gathered-key slot map
  that the eager backend derives from it once per step.
"""

from __future__ import annotations

import pytest
import torch

from cbcore.execution.batch import build_flat_batch
from cbcore.scheduling.block_manager import BlockManager
from cbcore.scheduling.sampling_params import SamplingParams
from cbcore.scheduling.sequence import Sequence
from cbcore.testing.block_invariants import check_blocks

BLOCK_SIZE = 16


def _table(first_block: int, num_tokens: int) -> list[int]:
    return list(range(first_block, first_block + -(-num_tokens // BLOCK_SIZE)))


def layout(name: str) -> tuple[list[tuple[list[int], int, list[int]]], list[bool]]:
    """``(token_ids, start, block_table)`` per sequence, and which ones sample."""
    chunks, sample = [], []
    next_block = 0

    def add(context: int, n: int, samples: bool) -> None:
        nonlocal next_block
        table = _table(next_block, context + n)
        next_block += len(table)
        chunks.append(([5] * n, context, table))
        sample.append(samples)

    base = name.removesuffix("+kv_slots")
    if base in ("decode-256", "mixed"):
        for i in range(256 if base == "decode-256" else 248):
            add(64 + (i * 37) % 512, 1, True)
    if base == "mixed":
        for i in range(8):
            add(256 * (i % 2), 256, i % 2 == 1)
    if base == "prefill-16":
        for _ in range(16):
            add(0, 512, True)
    return chunks, sample


LAYOUTS = ["decode-256", "mixed", "prefill-16", "decode-256+kv_slots"]


@pytest.mark.parametrize("name", LAYOUTS)
def test_pack_step(benchmark, name: str) -> None:
    chunks, sample = layout(name)
    cpu = torch.device("cpu")

    def pack():
        batch = build_flat_batch(chunks, sample, BLOCK_SIZE, cpu)
        if name.endswith("+kv_slots"):
            batch.kv_slots  # noqa: B018 - the cached property is the work being timed
        return batch

    batch = benchmark(pack)
    assert batch.num_seqs == len(chunks)
    assert batch.num_tokens == sum(len(ids) for ids, _, _ in chunks)
    assert len(batch.logits_indices) == sum(sample)
    # The last token of the first sequence lands in its own last block.
    ids, start, table = chunks[0]
    pos = start + len(ids) - 1
    assert int(batch.slot_mapping[len(ids) - 1]) == table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE


def _sequences(n: int) -> list[Sequence]:
    params = SamplingParams(max_new_tokens=1)
    return [Sequence(f"s{i}", [5] * 8, params) for i in range(n)]


def test_kv_allocate_and_free_256_sequences_of_512_tokens(benchmark) -> None:
    """A whole batch's worth of prompts gets its blocks, then gives them all back."""
    blocks = BlockManager(256 * 32, BLOCK_SIZE)
    seqs = _sequences(256)

    def cycle() -> int:
        for seq in seqs:
            blocks.grow(seq, 512)
        used = blocks.num_used_blocks
        for seq in seqs:
            blocks.free(seq)
        return used

    assert benchmark(cycle) == 256 * 32
    assert blocks.num_free_blocks == blocks.num_blocks
    check_blocks(blocks, seqs)


def test_kv_decode_growth_256_sequences(benchmark) -> None:
    """One decode step's bookkeeping: 256 sequences each ask room for one more token."""
    blocks = BlockManager(256 * 40, BLOCK_SIZE)
    seqs = _sequences(256)
    for i, seq in enumerate(seqs):
        blocks.grow(seq, 100 + i)  # contexts on and off block boundaries
        seq.num_computed_tokens = 100 + i

    def step() -> int:
        grown = 0
        for seq in seqs:
            if blocks.blocks_needed(seq, 1):
                grown += 1
            blocks.grow(seq, 1)
        return grown

    grown = benchmark.pedantic(step, rounds=1, iterations=1)
    assert grown == sum(1 for i in range(256) if (100 + i) % BLOCK_SIZE == 0)
    check_blocks(blocks, seqs)
