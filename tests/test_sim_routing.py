"""Routers over N simulated replicas: the same plugin classes `cb serve --replicas` runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cbcore import Router
from cbcore.bench.driver import VirtualClock, drive
from cbcore.bench.generator import generate
from cbcore.cli.main import main
from cbcore.config import EngineConfig
from cbcore.serve.config import Settings
from cbcore.sim.executor import sim_engine
from cbcore.sim.profile import load_profile
from cbcore.sim.routing import RouterPlacement, replica_ids
from cbcore.sim.suite import simulate_suite

WORKLOAD = "poisson:n=120,rate=40,lengths=sharegpt,seed=2"


class Recording(Router):
    """Least in flight, writing down what it saw."""

    name = "recording"

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[float, tuple, float]] = []

    def choose(self, request, replicas):
        self.seen.append(
            (request.request_id, tuple(r.queue_len for r in replicas), max(r.load_age_s for r in replicas))
        )
        return min(replicas, key=lambda r: (r.num_in_flight, r.replica_id)).replica_id


def run(router: Router, n: int, interval: float):
    profile = load_profile("h200-llama-3-8b")
    workload = generate(WORKLOAD, profile.model.vocab_size)
    ids = [r.token_ids(None) for r in workload.requests]
    cfg = EngineConfig.from_dict({}, ["scheduler.budget.max_num_seqs=4"])
    engines = [sim_engine(cfg, profile, VirtualClock()) for _ in range(n)]
    placement = RouterPlacement(router, n, interval)
    result = drive(engines, "x", workload, ids, placement=placement)
    return result, placement, workload


def test_replica_ids_sort_in_index_order() -> None:
    ids = replica_ids(12)
    assert ids == sorted(ids) and ids[0] == "replica-00" and ids[11] == "replica-11"


def test_loads_reach_the_router_at_the_stated_interval_and_in_flight_is_exact() -> None:
    router = Recording()
    result, placement, workload = run(router, 3, interval=0.25)
    assert all(o.finish_reason == "length" for o in result.outputs)
    assert all(age < 0.25 for _, _, age in router.seen)  # never older than the interval
    arrivals = {r.request_id: r.arrival_s for r in workload.requests}
    snapshots = {}
    for rid, queues, age in router.seen:
        snapshots.setdefault(round(arrivals[rid] - age, 9), set()).add(queues)
    assert all(len(s) == 1 for s in snapshots.values())  # one report per refresh, shared until the next
    assert len(snapshots) > 3 and any(any(q) for s in snapshots.values() for q in s)
    assert placement.in_flight == [0, 0, 0]  # every placed request was seen finishing
    assert sum(placement.placed) == len(workload.requests)


def test_cb_simulate_compares_routers_over_replicas(tmp_path: Path, capsys) -> None:
    out = tmp_path / "routers.json"
    rc = main(
        [
            "simulate", "--profile", "h200-llama-3-8b", "--workload", WORKLOAD, "--no-progress",
            "--replicas", "4", "--router", "round-robin", "--router", "least-loaded",
            "--set", "scheduler.budget.max_num_seqs=4", "--json", str(out),
        ]
    )  # fmt: skip
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["name"] for r in rows] == ["round-robin", "least-loaded"]
    assert all(r["completed"] == 120 and r["replicas"] == 4 for r in rows)
    assert rows[0]["placed_min_max"] == [30, 30]  # round robin: exactly a quarter each
    alone = tmp_path / "alone.json"
    assert main(["simulate", "--profile", "h200-llama-3-8b", "--workload", WORKLOAD, "--no-progress",
                 "--set", "scheduler.budget.max_num_seqs=4", "--json", str(alone)]) == 0  # fmt: skip
    # --router changes the router only: each replica's KV pool is the one a plain row gets
    assert {r["kv_blocks"] for r in rows} == {json.loads(alone.read_text())["rows"][0]["kv_blocks"]}
    assert main(["simulate", "--profile", "h200-llama-3-8b", "--router", "round-robin"]) == 2
    assert "--router needs --replicas" in capsys.readouterr().err


class Watching(Router):
    """Records the request fields and replica loads it is shown (what a deadline-aware router reads)."""

    name = "watching"

    def __init__(self) -> None:
        super().__init__()
        self.requests: list = []
        self.loads: list = []

    def choose(self, request, replicas):
        self.requests.append(request)
        self.loads.extend(r.load for r in replicas if r.load is not None)
        return min(replicas, key=lambda r: (r.num_in_flight, r.replica_id)).replica_id


def test_routers_see_what_policies_see_and_each_replicas_tokens() -> None:
    from cbcore.bench.workload import BenchRequest, Workload

    profile = load_profile("h200-llama-3-8b")
    reqs = tuple(
        BenchRequest(request_id=f"r{i}", arrival_s=0.001 * i, max_new_tokens=8 + i,
                     prompt_token_ids=tuple(range(1, 30 + i)), priority=i % 2,
                     client_id=f"c{i % 3}", deadline_s=1.0 + i, attrs={"tier": "gold" if i % 2 else "free"})
        for i in range(24)
    )  # fmt: skip
    workload = Workload("views", reqs)
    ids = [r.token_ids(None) for r in reqs]
    cfg = EngineConfig.from_dict({}, ["scheduler.budget.max_num_seqs=2"])
    engines = [sim_engine(cfg, profile, VirtualClock()) for _ in range(2)]
    router = Watching()
    drive(engines, "x", workload, ids, placement=RouterPlacement(router, 2, 0.001))
    seen = {r.request_id: r for r in router.requests}
    assert len(seen) == len(reqs)
    for req in reqs:
        got = seen[req.request_id]
        assert (got.num_prompt_tokens, got.max_tokens, got.priority, got.client_id, got.deadline_s) == (
            len(req.prompt_token_ids), req.max_new_tokens, req.priority, req.client_id, req.deadline_s
        )
        assert got.attrs["tier"] == req.attrs["tier"]
        assert router.predicted_output_len(got) == req.max_new_tokens
    assert any(load.num_waiting_tokens > 0 for load in router.loads)  # queued prompts, priced in tokens
    assert any(load.num_running_tokens > 0 and load.recent_step_s > 0 for load in router.loads)


def test_simulated_replicas_need_configs_that_hold_a_router() -> None:
    """An EngineConfig has no router: replicas over it are refused by row, before any row runs."""
    profile = load_profile("h200-llama-3-8b")
    workload = generate("poisson:n=4,rate=10,lengths=fixed,input_len=16,output_len=4", profile.model.vocab_size)
    ids = [r.token_ids(None) for r in workload.requests]
    rows = [("plain", EngineConfig()), ("whole", Settings.from_dict({"router": "round-robin"}))]
    with pytest.raises(TypeError, match=r"replicas=2: rows \['plain'\] have no router"):
        simulate_suite(profile, workload, ids, rows, replicas=2)
    result = simulate_suite(profile, workload, ids, rows[1:], replicas=2)
    assert result.rows[0]["router"] == {"name": "round-robin"} and result.rows[0]["completed"] == 4
    assert simulate_suite(profile, workload, ids, rows[:1]).rows[0]["completed"] == 4  # one engine: no router
