"""The readable reference backend: one additive block-diagonal causal mask."""

from __future__ import annotations

import torch

from cbcore.execution.backend import Backend
from cbcore.execution.batch import FlatBatch
from cbcore.execution.kv_cache import KVCache


class EagerBackend(Backend):
    """Matmul, additive mask, softmax, matmul — the seeds' picture, over the paged cache.

    Keys and values are gathered from each sequence's own blocks (no other
    sequence's cache is read), then every query is scored against every
    gathered key and the block-diagonal causal mask removes what it may not
    see. Work is O(T x K) per layer: simple and obviously right, which is the
    point of a reference; ``sdpa`` is the fast one.

    GQA is handled by viewing the query heads as ``[kv_heads, group]`` and
    broadcasting, so K/V are never repeated in memory.
    """

    name = "eager"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        layer_idx: int,
        batch: FlatBatch,
        kv_cache: KVCache,
        scaling: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        num_tokens, num_heads, head_dim = query.shape
        k, v = kv_cache.gather(layer_idx, batch.kv_slots)  # [K, Hkv, D]
        num_kv_heads = k.shape[1]
        group = num_heads // num_kv_heads

        mask = self._mask(batch, sliding_window, query.dtype)  # [T, K] additive
        q = query.reshape(num_tokens, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [Hkv, G, T, D]
        k = k.permute(1, 0, 2).unsqueeze(1)  # [Hkv, 1, K, D]
        v = v.permute(1, 0, 2).unsqueeze(1)
        scores = torch.matmul(q, k.transpose(-1, -2)) * scaling + mask
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        out = torch.matmul(probs, v)  # [Hkv, G, T, D]
        return out.permute(2, 0, 1, 3).reshape(num_tokens, num_heads, head_dim)

    @staticmethod
    def _mask(batch: FlatBatch, sliding_window: int | None, dtype: torch.dtype) -> torch.Tensor:
        key = ("eager_mask", sliding_window, dtype)
        mask = batch.scratch.get(key)
        if mask is None:
            allowed = block_diagonal_causal_mask(batch, sliding_window)
            mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
            mask.masked_fill_(~allowed, torch.finfo(dtype).min)
            batch.scratch[key] = mask
        return mask


def block_diagonal_causal_mask(batch: FlatBatch, sliding_window: int | None) -> torch.Tensor:
    """[T, K] bool: query t may see gathered key k (same sequence, not in the future, in the window)."""
    same_seq = batch.token_seq_index[:, None] == batch.kv_seq_index[None, :]
    delta = batch.positions[:, None] - batch.kv_positions[None, :]
    allowed = same_seq & (delta >= 0)
    if sliding_window is not None:
        allowed &= delta < sliding_window
    return allowed
