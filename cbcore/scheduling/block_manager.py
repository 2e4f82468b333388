"""Paged KV bookkeeping: which fixed-size block holds which tokens, and who reads it.

Pure Python and tensor-free, so schedulers and policies can reason about
memory (and tests can fuzz it) without a model. The tensors themselves live in
:class:`cbcore.execution.kv_cache.KVCache`; a block id here is a row there.

Prefix caching (``prefix_caching=True``): once a block is full and its KV
computed, it is registered under the hash of its tokens and everything before
them (:func:`extend_hashes`). Blocks carry reference counts, so
sequences with a common prefix map the same blocks. A freed block that is
registered keeps its KV and goes to an *evictable* list, least recently used
first; a later request with the same prefix revives it instead of computing
it, and allocation takes plain free blocks before it evicts anything. Only
full blocks are ever shared and a sequence only writes past its computed
tokens, so no shared block is ever written: sharing needs no copy-on-write.

Swap preemption copies every block of the victim to host memory and drops its
references; blocks other sequences still read stay on the device untouched
(copy on swap). Swapping back in takes fresh device blocks.

Block names: block ``i`` of a token stream is named by a digest of (the name
of block ``i - 1``, its ``block_size`` token ids); block 0's parent is a
digest of the request's cache salt, so requests with different salts never
share KV. The chain makes a block's name stand for the whole prefix up to its
end, which is what the KV of that block depends on. The digest is BLAKE2b
(128 bits) rather than Python's ``hash``: a tenant must not be able to craft a
prompt whose blocks collide with another tenant's cached prefix and so read
KV it never computed.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from typing import Any

from cbcore.scheduling.sequence import Sequence

BlockHash = bytes
_DIGEST = 16


def root_hash(salt: str | None) -> BlockHash:
    """The parent of a stream's first block: distinct per salt (None: no salt)."""
    if salt is None:
        return b""
    return hashlib.blake2b(b"salt:" + salt.encode(), digest_size=_DIGEST).digest()


def extend_hashes(hashes: list[BlockHash], token_ids: Seq[int], block_size: int, salt: str | None, upto: int) -> None:
    """Append to ``hashes`` (the chain of ``token_ids``' first blocks) until it names ``upto`` full blocks."""
    upto = min(upto, len(token_ids) // block_size)
    start = len(hashes)
    if start >= upto:
        return
    parent = hashes[-1] if hashes else root_hash(salt)
    # One conversion for all new blocks (a copy when the ids are an array('i')); 4-byte ids (vocabularies are far below 2**31).
    raw = array("i", token_ids[start * block_size : upto * block_size]).tobytes()
    width = block_size * 4
    blake = hashlib.blake2b
    for offset in range(0, len(raw), width):
        parent = blake(parent + raw[offset : offset + width], digest_size=_DIGEST).digest()
        hashes.append(parent)


class KVView:
    """What a policy may read about the KV cache (``state.kv``): counts, never the books themselves."""

    __slots__ = ("_blocks",)

    def __init__(self, blocks: BlockManager) -> None:
        object.__setattr__(self, "_blocks", blocks)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"a policy cannot set {name!r}: the KV cache is read-only for policies")

    num_blocks = property(lambda self: self._blocks.num_blocks)
    block_size = property(lambda self: self._blocks.block_size)
    num_free_blocks = property(lambda self: self._blocks.num_free_blocks)
    num_used_blocks = property(lambda self: self._blocks.num_used_blocks)
    num_cached_blocks = property(lambda self: self._blocks.num_cached_blocks)

    def blocks_needed(self, seq: Any, num_new_tokens: int) -> int:
        """Extra blocks ``seq`` (a view) needs to hold ``num_new_tokens`` more computed tokens."""
        total = self._blocks.blocks_for_tokens(seq.num_computed_tokens + num_new_tokens)
        return max(0, total - len(seq.block_table))


class BlockManager:
    """Allocates device blocks to sequences, shares cached prefixes, tracks the host (swap) pool."""

    def __init__(
        self, num_blocks: int, block_size: int, num_host_blocks: int = 0, *, prefix_caching: bool = False
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size, self.num_host_blocks = num_blocks, block_size, num_host_blocks
        self.prefix_caching = prefix_caching
        # Unregistered free blocks, a stack: the most recently freed is reused first (warm in cache).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        # Registered blocks nobody references, oldest first: evicted in this order when needed.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._ref: list[int] = [0] * num_blocks
        self._hash_of: list[BlockHash | None] = [None] * num_blocks
        self._by_hash: dict[BlockHash, int] = {}
        self._registered: dict[Sequence, int] = {}  # leading blocks of a sequence already registered
        self._free_host: list[int] = list(range(num_host_blocks - 1, -1, -1))
        self._host_tables: dict[str, list[int]] = {}
        # Tokens looked up at admissions and tokens found (what EngineLoad and /metrics report).
        self.prefix_cache_queries_tokens = self.prefix_cache_hits_tokens = 0
        self.view = KVView(self)

    # -- queries -------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: plain free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free) - len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Registered blocks, referenced or evictable."""
        return len(self._by_hash)

    @property
    def num_free_host_blocks(self) -> int:
        return len(self._free_host)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def ref_count(self, block: int) -> int:
        return self._ref[block]

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
        return self.blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    def num_freed_by(self, seqs: Iterable[Sequence]) -> int:
        """Blocks that freeing all of ``seqs`` would return (a block shared with others stays)."""
        held = Counter(b for s in seqs for b in s.block_table)
        ref = self._ref
        return sum(1 for block, n in held.items() if ref[block] == n)

    def host_blocks_of(self, seq: Sequence) -> list[int]:
        return self._host_tables.get(seq.request_id, [])

    # -- device blocks -------------------------------------------------------

    def grow(self, seq: Sequence, num_new_tokens: int) -> None:
        """Append blocks so that ``num_new_tokens`` more tokens of ``seq`` fit."""
        if not self.try_grow(seq, num_new_tokens):
            needed, free = self.blocks_needed(seq, num_new_tokens), self.num_free_blocks
            raise MemoryError(f"request {seq.request_id!r} needs {needed} KV blocks, {free} are free")

    def try_grow(self, seq: Sequence, num_new_tokens: int) -> bool:
        """:meth:`grow` if the blocks are free, else nothing; one check instead of two on the hot path."""
        needed = self.blocks_needed(seq, num_new_tokens)
        if needed > len(self._free) + len(self._evictable):
            return False
        for _ in range(needed):
            self._allocate(seq)
        return True

    def _allocate(self, seq: Sequence) -> int:
        """A free block (else the least recently used cached one, its KV overwritten) appended to ``seq``."""
        if self._free:
            block = self._free.pop()
        else:  # unregistered in place: a full cache evicts at nearly every allocation
            block, _ = self._evictable.popitem(last=False)
            del self._by_hash[self._hash_of[block]]  # type: ignore[index]
            self._hash_of[block] = None
        self._ref[block] = 1
        seq.block_table.append(block)
        return block

    def _unregister(self, block: int) -> None:
        del self._by_hash[self._hash_of[block]]  # type: ignore[index]
        self._hash_of[block] = None

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references; blocks nobody else reads are freed (cached ones stay findable)."""
        ref, hash_of, free, evictable = self._ref, self._hash_of, self._free, self._evictable
        # Last block first: a prefix's tail becomes least recently used before its head.
        for block in reversed(seq.block_table):
            count = ref[block] - 1
            if count < 0:
                raise RuntimeError(f"block {block} of request {seq.request_id!r} is not referenced")
            ref[block] = count
            if count == 0:
                if hash_of[block] is None:
                    free.append(block)
                else:
                    evictable[block] = None
        seq.block_table = []
        self._registered.pop(seq, None)

    def reset_prefix_cache(self) -> int:
        """Forget every evictable cached block (they become plain free blocks); returns how many."""
        dropped = list(self._evictable)
        for block in dropped:
            self._unregister(block)
        self._evictable.clear()
        self._free.extend(reversed(dropped))
        return len(dropped)

    # -- prefix caching ------------------------------------------------------

    def _hashes(self, seq: Sequence, upto: int) -> list[BlockHash]:
        extend_hashes(seq.block_hashes, seq.token_ids, self.block_size, seq.cache_salt, upto)
        return seq.block_hashes

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks of ``seq``'s leading full blocks, up to the first miss (never its last token)."""
        limit = (seq.num_tokens - 1) // self.block_size
        found = list(map(self._by_hash.get, self._hashes(seq, limit)[:limit]))  # (C loops: a prompt is ~10^3 blocks)
        return found[: found.index(None)] if None in found else found

    def lookup(self, seq: Sequence) -> int:
        """Tokens of ``seq`` the cache holds now, without taking them (also stored on the sequence).

        At most ``seq.num_tokens - 1``: the last token is always computed so that
        its step has logits to sample from.
        """
        if not self.prefix_caching:
            return 0
        seq.num_cached_prompt_tokens = len(self._cached_prefix(seq)) * self.block_size
        return seq.num_cached_prompt_tokens

    def acquire_cached(self, seq: Sequence) -> int:
        """Map ``seq``'s cached prefix into its empty block table; returns the tokens skipped.

        ``seq.num_computed_tokens`` moves past them, so the prefill policy and
        the token budget see only what is left to compute. Undo with :meth:`free`
        (and reset ``num_computed_tokens``) if the sequence is not admitted.
        """
        if seq.block_table or seq.num_computed_tokens:
            raise RuntimeError(
                f"request {seq.request_id!r} already holds KV; only a new prefill can hit the cache"
            )
        if not self.prefix_caching:
            return 0
        ref, table, evictable = self._ref, seq.block_table, self._evictable
        table += self._cached_prefix(seq)
        for block in table:
            if not ref[block]:
                del evictable[block]
            ref[block] += 1
        self._registered[seq] = len(table)
        seq.num_computed_tokens = seq.num_cached_prompt_tokens = len(table) * self.block_size
        return seq.num_computed_tokens

    def record_lookup(self, seq: Sequence, hit_tokens: int) -> None:
        """Count an admission's lookup: the tokens it had to prefill and those the cache held."""
        if self.prefix_caching:
            self.prefix_cache_queries_tokens += seq.num_tokens
            self.prefix_cache_hits_tokens += hit_tokens
            seq.prefix_cache_queries += seq.num_tokens
            seq.prefix_cache_hits += hit_tokens

    def register_computed(self, seqs: Iterable[Sequence]) -> None:
        """Register the blocks of ``seqs`` that are full and computed (call once their KV is written).

        A block whose prefix another block already holds stays unregistered:
        it is freed normally and the first copy remains the one that is found.
        One call per step for all of them: most steps fill no block.
        """
        size, registered = self.block_size, self._registered
        for seq in seqs if self.prefix_caching else ():
            if (full := seq.num_computed_tokens // size) <= (done := registered.get(seq, 0)):
                continue
            for block, h in zip(seq.block_table[done:full], self._hashes(seq, full)[done:full], strict=True):
                if self._hash_of[block] is None and h not in self._by_hash:
                    self._by_hash[h] = block
                    self._hash_of[block] = h
            registered[seq] = full

    # -- host (swap) blocks --------------------------------------------------

    def can_swap_out(self, seq: Sequence) -> bool:
        return len(seq.block_table) <= len(self._free_host)

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Copy ``seq``'s blocks to host blocks and drop its references; returns (device, host) pairs."""
        if not self.can_swap_out(seq):
            raise MemoryError(f"no host room to swap out request {seq.request_id!r}")
        pairs = [(block, self._free_host.pop()) for block in seq.block_table]
        self._host_tables[seq.request_id] = [host for _, host in pairs]
        self.free(seq)
        return pairs

    def can_swap_in(self, seq: Sequence, num_new_tokens: int = 0) -> bool:
        host = self._host_tables[seq.request_id]
        total = max(len(host), self.blocks_for_tokens(seq.num_computed_tokens + num_new_tokens))
        return total <= self.num_free_blocks

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Bring ``seq``'s blocks back into fresh device blocks; returns (host, device) pairs."""
        host_table = self._host_tables.pop(seq.request_id)
        if len(host_table) > self.num_free_blocks:
            self._host_tables[seq.request_id] = host_table
            raise MemoryError(f"no device room to swap in request {seq.request_id!r}")
        pairs = [(host, self._allocate(seq)) for host in host_table]
        self._free_host.extend(host_table)
        return pairs

    def drop_host(self, seq: Sequence) -> None:
        """Forget a swapped sequence's host copy (it was aborted or failed)."""
        self._free_host.extend(self._host_tables.pop(seq.request_id, []))

    # -- undo ----------------------------------------------------------------

    def undo_point(self) -> tuple[dict[str, list[int]], int, int]:
        """What :meth:`reset_to` needs besides the sequences: host tables (their lists are never
        mutated, only replaced) and the lookup counters. O(swapped sequences)."""
        return dict(self._host_tables), self.prefix_cache_queries_tokens, self.prefix_cache_hits_tokens

    def reset_to(self, live: list[Sequence], point: tuple[dict[str, list[int]], int, int]) -> None:
        """Rebuild the books from ``live`` sequences' block tables and an :meth:`undo_point`.

        Used to undo a failed step: reference counts are recounted from the
        tables, every block nobody references is free (or evictable if it still
        holds a registered prefix, whose KV is intact), so nothing has to be
        recorded per block while the step runs. A cached block the failed step
        evicted stays forgotten: the cache loses an entry, never correctness.
        """
        host_tables, self.prefix_cache_queries_tokens, self.prefix_cache_hits_tokens = point
        ref = self._ref = [0] * self.num_blocks
        hashed = self._hash_of
        for seq in live:
            for block in seq.block_table:
                ref[block] += 1
            for block in seq.block_table[seq.num_computed_tokens // self.block_size :]:
                if hashed[block] is not None:  # registered by the failed step, past what now counts as computed
                    self._unregister(block)
        self._evictable = OrderedDict.fromkeys(b for b in self._evictable if not ref[b])
        # Taken from the cache by the failed step: most recently used (a key already there keeps its place).
        unheld = [b for b in range(self.num_blocks) if not ref[b]]
        self._evictable.update(dict.fromkeys(b for b in unheld if hashed[b] is not None))
        self._free = [b for b in reversed(unheld) if hashed[b] is None]
        held = set(live)
        self._registered = {
            s: min(n, s.num_computed_tokens // self.block_size) for s, n in self._registered.items() if s in held
        }
        self._host_tables = dict(host_tables)
        used = {h for table in host_tables.values() for h in table}
        self._free_host = [h for h in range(self.num_host_blocks - 1, -1, -1) if h not in used]
