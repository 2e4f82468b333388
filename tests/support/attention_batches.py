"""Hand-built packed steps for backend tests: a FlatBatch, a filled paged cache, and q/k/v.

Each sequence is ``(prior_context, query_len)``: its earlier tokens already sit
in the cache (random K/V), and this step's ``query_len`` tokens are written
through the slot mapping exactly as the attention bridge does. Blocks are
handed out in a shuffled order so that no sequence's blocks are contiguous.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cbcore.bench.stepcost import torch_threads  # noqa: F401  (re-exported for the backend tests)
from cbcore.execution.batch import FlatBatch, build_flat_batch
from cbcore.execution.kv_cache import KVCache

# decode rows, a fresh prompt, chunks after earlier context, a one-token prompt
MIXED_STEP = [(10, 1), (0, 7), (5, 6), (30, 1), (0, 1), (3, 1), (0, 40), (17, 9), (64, 1)]




@dataclass
class PackedStep:
    batch: FlatBatch
    cache: KVCache
    query: torch.Tensor  # [T, H, D]
    key: torch.Tensor  # [T, Hkv, D]
    value: torch.Tensor


def packed_step(
    seqs: list[tuple[int, int]],
    *,
    num_heads: int = 8,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    block_size: int = 4,
    num_layers: int = 1,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> PackedStep:
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-(prior + q) // block_size) for prior, q in seqs]
    num_blocks = sum(needed) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    chunks, taken = [], 0
    for (prior, q), n in zip(seqs, needed, strict=True):
        chunks.append((list(range(3, 3 + q)), prior, order[taken : taken + n]))
        taken += n
    device = torch.device(device)
    batch = build_flat_batch(chunks, [True] * len(seqs), block_size, device)
    cache = KVCache(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    total = batch.num_tokens

    def rand(heads: int) -> torch.Tensor:
        # [T, heads, D] as a view of [heads, T, D], the layout the attention bridge hands over
        x = torch.randn((heads, total, head_dim), generator=gen).to(device=device, dtype=dtype)
        return x.transpose(0, 1)

    query, key, value = rand(num_heads), rand(num_kv_heads), rand(num_kv_heads)
    for layer in range(num_layers):
        cache.write(layer, batch.slot_mapping, key, value)
    return PackedStep(batch, cache, query, key, value)
