"""The paged KV tensors: in-place writes, per-sequence gathers, swap round trips."""

from __future__ import annotations

import torch

from cbcore.execution.batch import build_flat_batch
from cbcore.execution.kv_cache import KVCache


def make_cache(host: int = 0) -> KVCache:
    return KVCache(
        2,
        num_blocks=6,
        block_size=4,
        num_kv_heads=2,
        head_dim=3,
        dtype=torch.float32,
        device="cpu",
        num_host_blocks=host,
    )


def test_write_then_gather_returns_each_sequence_in_order():
    cache = make_cache()
    # seq 0: 5 cached tokens in blocks [3, 1], 1 new; seq 1: a 3-token prompt in block [4].
    batch = build_flat_batch([([9], 5, [3, 1]), ([1, 2, 3], 0, [4])], [True, True], 4, torch.device("cpu"))
    assert batch.slot_mapping.tolist() == [1 * 4 + 1, 16, 17, 18]
    assert batch.positions.tolist() == [5, 0, 1, 2]
    assert batch.cu_seqlens_q.tolist() == [0, 1, 4] and batch.cu_seqlens_k.tolist() == [0, 6, 9]
    assert batch.logits_indices.tolist() == [0, 3]
    assert batch.kv_slots.tolist() == [12, 13, 14, 15, 4, 5, 16, 17, 18]
    assert batch.kv_positions.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2]
    k = torch.randn(4, 2, 3)
    cache.write(1, batch.slot_mapping, k, -k)
    got_k, got_v = cache.gather(1, batch.slot_mapping)
    assert torch.equal(got_k, k) and torch.equal(got_v, -k)
    assert cache.k[0].abs().sum() == 0, "other layers untouched"


def test_non_sampling_chunk_has_no_logits_row():
    batch = build_flat_batch([([1, 2, 3, 4], 0, [0]), ([7], 2, [1])], [False, True], 4, torch.device("cpu"))
    assert batch.logits_indices.tolist() == [4]
    assert batch.sample_rows == [1]


def test_swap_round_trip_restores_blocks_exactly():
    cache = make_cache(host=3)
    cache.k.normal_()
    cache.v.normal_()
    saved_k, saved_v = cache.k[:, 8:16].clone(), cache.v[:, 8:16].clone()  # blocks 2 and 3
    cache.copy_out([(2, 0), (3, 2)])
    cache.k[:, 8:16] = 0
    cache.v[:, 8:16] = 0
    cache.copy_in([(0, 5), (2, 1)])  # back into different device blocks
    assert torch.equal(cache.k[:, 20:24], saved_k[:, :4]) and torch.equal(cache.k[:, 4:8], saved_k[:, 4:])
    assert torch.equal(cache.v[:, 20:24], saved_v[:, :4]) and torch.equal(cache.v[:, 4:8], saved_v[:, 4:])
