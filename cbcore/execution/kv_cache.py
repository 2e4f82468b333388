"""The paged KV tensors: one K and one V pool per layer, written in place.

Layout per layer: ``[num_blocks * block_size, num_kv_heads, head_dim]`` — a
flat array of *slots*. Slot ``b * block_size + i`` is position ``i`` of block
``b``. A step writes its new K/V with one ``index_copy_`` through the slot
mapping; nothing is ever re-concatenated. Backends that want the blocked view
(FlashAttention's paged kernels) get it with :meth:`blocked`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(eq=False)
class KVCache:
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device | str
    num_host_blocks: int = 0

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        shape = (self.num_layers, self.num_blocks * self.block_size, self.num_kv_heads, self.head_dim)
        self.k, self.v = (torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(2))
        host = (self.num_layers, self.num_host_blocks * self.block_size, *shape[2:])
        pin = self.device.type == "cuda"
        self.host_k, self.host_v = (torch.zeros(host, dtype=self.dtype, pin_memory=pin) for _ in range(2))

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store this step's keys/values (``[T, kv_heads, head_dim]``) at their slots."""
        self.k[layer].index_copy_(0, slot_mapping, k.to(self.dtype))
        self.v[layer].index_copy_(0, slot_mapping, v.to(self.dtype))

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values at ``slots`` (``[N, kv_heads, head_dim]``)."""
        return self.k[layer].index_select(0, slots), self.v[layer].index_select(0, slots)

    def blocked(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``[num_blocks, block_size, kv_heads, head_dim]`` of one layer (no copy)."""
        shape = (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        return self.k[layer].view(shape), self.v[layer].view(shape)

    def copy_out(self, pairs: list[tuple[int, int]]) -> None:
        """Device block -> host block, for every layer at once."""
        self._copy(pairs, (self.k, self.v), (self.host_k, self.host_v))

    def copy_in(self, pairs: list[tuple[int, int]]) -> None:
        """Host block -> device block, for every layer at once."""
        self._copy(pairs, (self.host_k, self.host_v), (self.k, self.v))

    def _copy(self, pairs: list[tuple[int, int]], sources: tuple, targets: tuple) -> None:
        if pairs:
            blocks = torch.tensor(pairs, dtype=torch.long).T[:, :, None]  # [2, n, 1]: sources, targets
            src, dst = (blocks * self.block_size + torch.arange(self.block_size)).flatten(1)  # their slots
            for source, target in zip(sources, targets, strict=True):
                target[:, dst.to(target.device)] = source[:, src.to(source.device)].to(target.device)
