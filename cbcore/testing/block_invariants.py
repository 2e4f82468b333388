"""The block manager's books, audited: what every fuzz and robustness test asserts after each step.

Kept out of :class:`~cbcore.scheduling.block_manager.BlockManager`: no step
runs it, and it reads the manager's private tables on purpose (it checks
them against the sequences, from the outside).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence as Seq

from cbcore.scheduling.block_manager import BlockHash, BlockManager, extend_hashes
from cbcore.scheduling.sequence import Sequence


def chain_hashes(token_ids: Seq[int], block_size: int, salt: str | None) -> list[BlockHash]:
    """The hashes of every full block of ``token_ids`` (computed afresh, to check the manager's incremental ones)."""
    hashes: list[BlockHash] = []
    extend_hashes(hashes, token_ids, block_size, salt, len(token_ids) // block_size)
    return hashes


def check_blocks(self: BlockManager, live: list[Sequence]) -> None:
    """Raise AssertionError unless the books balance for ``live``, the sequences holding device blocks.

    Reference counts equal the number of tables holding each block; a block
    is referenced, or plain free, or evictable, never two of these; only
    registered, full, computed blocks are shared; every registered block in
    a table holds exactly the tokens its hash names; nothing leaked.
    """
    held: Counter[int] = Counter()
    for seq in live:
        table = seq.block_table
        if len(set(table)) != len(table):
            raise AssertionError(f"request {seq.request_id!r} holds a block twice: {table}")
        if len(table) * self.block_size < seq.num_computed_tokens:
            raise AssertionError(
                f"request {seq.request_id!r} has {seq.num_computed_tokens} computed tokens in {len(table)} blocks"
            )
        held.update(table)
        _check_hashes(self, seq)
    for block, n in held.items():
        if self._ref[block] != n:
            raise AssertionError(
                f"block {block} is in {n} block tables but its reference count is {self._ref[block]}"
            )
        if n > 1 and self._hash_of[block] is None:
            raise AssertionError(f"block {block} is shared by {n} sequences but holds no cached prefix")
    free, evictable = set(self._free), set(self._evictable)
    if len(free) != len(self._free):
        raise AssertionError("a block is on the free list twice")
    for name, pool in (("free", free), ("evictable", evictable)):
        if pool & held.keys():
            raise AssertionError(f"blocks both {name} and referenced: {sorted(pool & held.keys())}")
    if free & evictable:
        raise AssertionError(f"blocks both free and evictable: {sorted(free & evictable)}")
    if any(self._hash_of[b] is not None for b in free) or any(
        self._hash_of[b] is None for b in evictable
    ):
        raise AssertionError("a free block is registered or an evictable one is not")
    unreferenced = [b for b in range(self.num_blocks) if self._ref[b] and b not in held]
    if unreferenced:
        raise AssertionError(f"blocks {unreferenced} are referenced by no live sequence (leaked)")
    if len(free) + len(evictable) + len(held) != self.num_blocks:
        raise AssertionError(f"{self.num_blocks - len(free) - len(evictable) - len(held)} blocks leaked")
    for h, block in self._by_hash.items():
        if self._hash_of[block] != h:
            raise AssertionError(f"hash index names block {block}, which holds another prefix")
    if sum(h is not None for h in self._hash_of) != len(self._by_hash):
        raise AssertionError("a block is registered under a hash the index does not know")
    host_used = [h for table in self._host_tables.values() for h in table]
    if len(set(host_used)) != len(host_used) or set(host_used) & set(self._free_host):
        raise AssertionError("host blocks double-owned")
    if len(host_used) + len(self._free_host) != self.num_host_blocks:
        raise AssertionError("host blocks leaked")

def _check_hashes(self: BlockManager, seq: Sequence) -> None:
    """A registered block in ``seq``'s table must be full, computed, and hold exactly ``seq``'s tokens."""
    full = seq.num_computed_tokens // self.block_size
    truth = chain_hashes(seq.token_ids, self.block_size, seq.cache_salt)
    if seq.block_hashes != truth[: len(seq.block_hashes)]:
        raise AssertionError(
            f"request {seq.request_id!r}: its stored block hashes no longer match its tokens"
        )
    for i, block in enumerate(seq.block_table):
        h = self._hash_of[block]
        if h is None:
            continue
        if i >= full:
            raise AssertionError(
                f"block {block} of request {seq.request_id!r} is registered before its KV is complete"
            )
        if h != truth[i]:
            raise AssertionError(
                f"block {block} of request {seq.request_id!r} is registered under another prefix"
            )
