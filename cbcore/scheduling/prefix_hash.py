"""Content hashes of full KV blocks: what makes a cached prefix findable.

Block ``i`` of a token stream is named by a digest of (the name of block
``i - 1``, its ``block_size`` token ids); block 0's parent is a digest of the
request's cache salt, so requests with different salts never share KV. The
chain makes a block's name stand for the whole prefix up to its end, which is
what the KV of that block depends on.

The digest is BLAKE2b (128 bits) rather than Python's ``hash``: a tenant must
not be able to craft a prompt whose blocks collide with another tenant's
cached prefix and so read KV it never computed.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence as Seq

BlockHash = bytes

_DIGEST = 16


def root_hash(salt: str | None) -> BlockHash:
    """The parent of a stream's first block: distinct per salt (None: no salt)."""
    if salt is None:
        return b""
    return hashlib.blake2b(b"salt:" + salt.encode(), digest_size=_DIGEST).digest()


def extend_hashes(
    hashes: list[BlockHash], token_ids: Seq[int], block_size: int, salt: str | None, upto: int
) -> None:
    """Append to ``hashes`` (the chain of ``token_ids``' first blocks) until it names ``upto`` full blocks."""
    upto = min(upto, len(token_ids) // block_size)
    start = len(hashes)
    if start >= upto:
        return
    parent = hashes[-1] if hashes else root_hash(salt)
    # One conversion for all new blocks; 4-byte ids (vocabularies are far below 2**32).
    raw = array("I", token_ids[start * block_size : upto * block_size]).tobytes()
    width = block_size * 4
    blake = hashlib.blake2b
    for offset in range(0, len(raw), width):
        parent = blake(parent + raw[offset : offset + width], digest_size=_DIGEST).digest()
        hashes.append(parent)
