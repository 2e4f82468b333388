"""Prefix affinity: requests that start alike go to the same replica, so its prefix cache hits."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence as Seq

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt

from cbcore.scale.router import ReplicaView, Router, RouteRequest, least_in_flight


class PrefixAffinityParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    block_size: PositiveInt = Field(16, description="tokens per hashed block; match the replicas' kv_cache.block_size")
    num_blocks: PositiveInt = Field(4, description="how many leading full blocks form the affinity key")
    max_imbalance: NonNegativeInt = Field(
        8, description="requests in flight beyond the least busy replica's at which affinity gives way"
    )


class PrefixAffinity(Router):
    """Hash the prompt's first full blocks; place the hash on a replica by rendezvous hashing.

    Rendezvous (highest random weight) hashing gives every replica a score per
    key and takes the highest, so when a replica leaves only its own keys
    move, and when one joins it takes a fair share from each of the others.
    A prompt shorter than one block has no key and goes to the replica with
    the fewest requests in flight; so does a request whose preferred replica
    has more than ``max_imbalance`` requests in flight beyond the least busy
    one, so that one hot prefix cannot pile up on one replica.
    The key is a hash of token ids only: it needs no prefix cache to exist,
    and lines up with one whose blocks are ``block_size`` tokens.
    """

    name = "prefix-affinity"
    Params = PrefixAffinityParams

    def prefix_key(self, token_ids: Seq[int]) -> bytes | None:
        size = self.params.block_size
        n = min(self.params.num_blocks, len(token_ids) // size) * size
        if n == 0:
            return None
        data = b"".join(int(t).to_bytes(4, "little", signed=False) for t in token_ids[:n])
        return hashlib.blake2b(data, digest_size=16).digest()

    def choose(self, request: RouteRequest, replicas: Seq[ReplicaView]) -> str:
        least = least_in_flight(replicas)
        key = self.prefix_key(request.prompt_token_ids)
        if key is None:
            return least.replica_id
        preferred = max(replicas, key=lambda r: _weight(key, r.replica_id))
        if preferred.num_in_flight - least.num_in_flight > self.params.max_imbalance:
            return least.replica_id
        return preferred.replica_id


def _weight(key: bytes, replica_id: str) -> bytes:
    return hashlib.blake2b(key + replica_id.encode(), digest_size=8).digest()
