"""Power of two choices: the less loaded of two replicas drawn at random."""

from __future__ import annotations

import random
from collections.abc import Sequence as Seq

from pydantic import Field

from cbcore.policies.routers.least_loaded import LoadParams, load_key
from cbcore.scale.router import ReplicaView, Router, RouteRequest


class PowerOfTwoParams(LoadParams):
    seed: int = Field(0, description="seed of the draws, so that a run can be repeated")


class PowerOfTwo(Router):
    """Draw two distinct replicas, keep the less loaded (Mitzenmacher's two choices).

    With stale load reports it avoids the herd of :class:`LeastLoaded`: the
    least loaded replica is only in half the draws, so one stale report
    cannot pull every request to it. Seeded, so a simulation is reproducible.
    """

    name = "power-of-two"
    Params = PowerOfTwoParams

    def __init__(self, params=None) -> None:
        super().__init__(params)
        self._rng = random.Random(self.params.seed)
        self._key = load_key(self.params.by)

    def choose(self, request: RouteRequest, replicas: Seq[ReplicaView]) -> str:
        drawn = self._rng.sample(list(replicas), min(2, len(replicas)))
        return min(drawn, key=self._key).replica_id
