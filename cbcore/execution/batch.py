"""FlatBatch: one step's tokens packed into a single padding-free row.

Sequences are laid out one after another (``[1, T]``); ``cu_seqlens_q`` marks
where each one's query tokens start and ``cu_seqlens_k`` where its keys start
in the per-sequence gathered key space (its whole context: cached tokens plus
this step's). All index tensors are built once per step with vectorised torch
ops (Python work is per sequence, not per token) and shared by every layer.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(eq=False)
class FlatBatch:
    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long, position of each token within its own sequence
    query_lens: list[int]  # per sequence: tokens run this step
    context_lens: list[int]  # per sequence: tokens in its KV after this step
    cu_seqlens_q: torch.Tensor  # [B+1] int32
    cu_seqlens_k: torch.Tensor  # [B+1] int32
    slot_mapping: torch.Tensor  # [T] long, KV slot each new token is written to
    block_tables: torch.Tensor  # [B, max_blocks] int32 (rows padded with 0)
    logits_indices: torch.Tensor  # [S] long, row of T whose logits are sampled
    sample_rows: list[int]  # per sampled sequence: its index in the batch
    block_size: int
    sampling: list[Any] = field(default_factory=list)  # the plan rows that sample (their params and RNGs)
    # Per-step scratch space for backends (masks, plans): built on the first
    # layer, reused by the others.
    scratch: dict[str, Any] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    @cached_property
    def token_seq_index(self) -> torch.Tensor:
        """[T]: which sequence each query token belongs to."""
        return torch.repeat_interleave(torch.tensor(self.query_lens, device=self.device))

    @cached_property
    def kv_seq_index(self) -> torch.Tensor:
        """[K]: which sequence each gathered key belongs to (K = sum of context_lens)."""
        return torch.repeat_interleave(torch.tensor(self.context_lens, device=self.device))

    @cached_property
    def kv_positions(self) -> torch.Tensor:
        """[K]: position of each gathered key within its sequence."""
        idx = self.kv_seq_index
        return torch.arange(idx.shape[0], device=self.device) - self.cu_seqlens_k.long()[idx]

    @cached_property
    def kv_slots(self) -> torch.Tensor:
        """[K]: cache slot of each sequence's keys, in order — only its own blocks are read."""
        pos = self.kv_positions
        blocks = self.block_tables.long()[self.kv_seq_index, pos // self.block_size]
        return blocks * self.block_size + pos % self.block_size


def build_flat_batch(
    chunks: list[tuple[list[int], int, list[int]]], sample: list[bool], block_size: int, device: torch.device
) -> FlatBatch:
    """Pack ``(token_ids, start_position, block_table)`` per sequence into one row.

    ``token_ids`` are the tokens run this step, starting at ``start_position``
    of that sequence; ``sample[i]`` says whether sequence ``i`` samples a token
    from its last position (false for a non-final prefill chunk).
    """
    query_lens = [len(ids) for ids, _, _ in chunks]
    starts = [start for _, start, _ in chunks]
    context_lens = [s + q for s, q in zip(starts, query_lens, strict=True)]
    flat_ids = list(itertools.chain.from_iterable(ids for ids, _, _ in chunks))

    q_lens = torch.tensor(query_lens, dtype=torch.int32)
    cu_q = F.pad(q_lens.cumsum(0, dtype=torch.int32), (1, 0))
    cu_k = F.pad(torch.tensor(context_lens).cumsum(0, dtype=torch.int32), (1, 0))

    width = max([1, *(len(t) for _, _, t in chunks)])
    padded = [t + [0] * (width - len(t)) for _, _, t in chunks]
    block_tables = torch.tensor(padded, dtype=torch.int32).view(-1, width)

    seq_of_token = torch.repeat_interleave(torch.arange(len(chunks)), q_lens.long())
    # Row r of T, in sequence s, is position starts[s] + r - cu_q[s] of its sequence.
    shift = torch.tensor(starts, dtype=torch.long) - cu_q[:-1]
    positions = shift[seq_of_token] + torch.arange(len(flat_ids))
    blocks = block_tables.long()[seq_of_token, positions // block_size]
    slot_mapping = blocks * block_size + positions % block_size
    sample_rows = [i for i, s in enumerate(sample) if s]
    logits_indices = cu_q.long()[1:][sample_rows] - 1 if sample_rows else torch.zeros(0, dtype=torch.long)

    return FlatBatch(
        input_ids=torch.tensor(flat_ids, dtype=torch.long).to(device, non_blocking=True),
        positions=positions.to(device, non_blocking=True),
        query_lens=query_lens,
        context_lens=context_lens,
        cu_seqlens_q=cu_q.to(device, non_blocking=True),
        cu_seqlens_k=cu_k.to(device, non_blocking=True),
        slot_mapping=slot_mapping.to(device, non_blocking=True),
        block_tables=block_tables.to(device, non_blocking=True),
        logits_indices=logits_indices.to(device, non_blocking=True),
        sample_rows=sample_rows,
        block_size=block_size,
    )
