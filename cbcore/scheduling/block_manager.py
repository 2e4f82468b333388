"""Paged KV bookkeeping: which fixed-size block belongs to which sequence.

Pure Python and tensor-free, so schedulers and policies can reason about
memory (and tests can fuzz it) without a model. The tensors themselves live in
:class:`cbcore.kv_cache.KVCache`; a block id here is a row there.
"""

from __future__ import annotations

from cbcore.scheduling.sequence import Sequence


class BlockManager:
    """Allocates device blocks to sequences; also tracks the host (swap) pool."""

    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_host_blocks = num_host_blocks
        # Stacks: the most recently freed block is reused first (warm in cache).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._free_host: list[int] = list(range(num_host_blocks - 1, -1, -1))
        self._owner: list[str | None] = [None] * num_blocks
        self._host_tables: dict[str, list[int]] = {}

    # -- queries -------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_free_host_blocks(self) -> int:
        return len(self._free_host)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Extra blocks ``seq`` needs to hold ``num_new_tokens`` more computed tokens."""
        total = self.blocks_for_tokens(seq.num_computed_tokens + num_new_tokens)
        return max(0, total - len(seq.block_table))

    def needing_a_block(self, decodes: list[Sequence]) -> list[Sequence]:
        """Those of ``decodes`` whose next token starts a new block (their cache is full)."""
        size = self.block_size
        return [s for s in decodes if s.num_computed_tokens >= len(s.block_table) * size]

    def can_grow(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= len(self._free)

    def host_blocks_of(self, seq: Sequence) -> list[int]:
        return self._host_tables.get(seq.request_id, [])

    # -- device blocks -------------------------------------------------------

    def grow(self, seq: Sequence, num_new_tokens: int) -> None:
        """Append blocks so that ``num_new_tokens`` more tokens of ``seq`` fit."""
        if not self.try_grow(seq, num_new_tokens):
            needed = self.blocks_needed(seq, num_new_tokens)
            raise MemoryError(
                f"request {seq.request_id!r} needs {needed} KV blocks, {len(self._free)} are free"
            )

    def try_grow(self, seq: Sequence, num_new_tokens: int) -> bool:
        """:meth:`grow` if the blocks are free, else nothing; one check instead of two on the hot path."""
        needed = self.blocks_needed(seq, num_new_tokens)
        if needed > len(self._free):
            return False
        for _ in range(needed):
            block = self._free.pop()
            self._owner[block] = seq.request_id
            seq.block_table.append(block)
        return True

    def free(self, seq: Sequence) -> None:
        """Return every device block of ``seq`` to the pool."""
        for block in seq.block_table:
            if self._owner[block] != seq.request_id:
                raise RuntimeError(
                    f"block {block} is owned by {self._owner[block]!r}, not {seq.request_id!r}"
                )
            self._owner[block] = None
            self._free.append(block)
        seq.block_table = []

    # -- host (swap) blocks --------------------------------------------------

    def can_swap_out(self, seq: Sequence) -> bool:
        return len(seq.block_table) <= len(self._free_host)

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move ``seq``'s blocks to host blocks; returns (device, host) pairs to copy."""
        if not self.can_swap_out(seq):
            raise MemoryError(f"no host room to swap out request {seq.request_id!r}")
        pairs = []
        host_table = []
        for block in seq.block_table:
            host = self._free_host.pop()
            host_table.append(host)
            pairs.append((block, host))
        self._host_tables[seq.request_id] = host_table
        self.free(seq)
        return pairs

    def can_swap_in(self, seq: Sequence, num_new_tokens: int = 0) -> bool:
        host = self._host_tables[seq.request_id]
        total = max(len(host), self.blocks_for_tokens(seq.num_computed_tokens + num_new_tokens))
        return total <= len(self._free)

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Bring ``seq``'s blocks back; returns (host, device) pairs to copy."""
        host_table = self._host_tables.pop(seq.request_id)
        if len(host_table) > len(self._free):
            self._host_tables[seq.request_id] = host_table
            raise MemoryError(f"no device room to swap in request {seq.request_id!r}")
        pairs = []
        for host in host_table:
            block = self._free.pop()
            self._owner[block] = seq.request_id
            seq.block_table.append(block)
            pairs.append((host, block))
            self._free_host.append(host)
        return pairs

    def drop_host(self, seq: Sequence) -> None:
        """Forget a swapped sequence's host copy (it was aborted or failed)."""
        self._free_host.extend(self._host_tables.pop(seq.request_id, []))

    # -- invariants ----------------------------------------------------------

    def check(self, live: list[Sequence]) -> None:
        """Raise if any block is owned twice, leaked, or both free and owned."""
        seen: dict[int, str] = {}
        for seq in live:
            for block in seq.block_table:
                if block in seen:
                    raise AssertionError(f"block {block} owned by {seen[block]!r} and {seq.request_id!r}")
                seen[block] = seq.request_id
                if self._owner[block] != seq.request_id:
                    raise AssertionError(
                        f"block {block} in {seq.request_id!r} but owner is {self._owner[block]!r}"
                    )
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a block is on the free list twice")
        if free & seen.keys():
            raise AssertionError(f"blocks both free and owned: {sorted(free & seen.keys())}")
        if len(free) + len(seen) != self.num_blocks:
            raise AssertionError(f"{self.num_blocks - len(free) - len(seen)} blocks leaked")
        host_used = [h for table in self._host_tables.values() for h in table]
        if len(set(host_used)) != len(host_used) or set(host_used) & set(self._free_host):
            raise AssertionError("host blocks double-owned")
        if len(host_used) + len(self._free_host) != self.num_host_blocks:
            raise AssertionError("host blocks leaked")
