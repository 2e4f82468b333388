"""Capacity search: a planted threshold is found within the tolerance; the objectives; end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cbcore.bench.capacity import Objective, rate_spec, run_capacity, search
from cbcore.bench.replicates import spec_value
from cbcore.bench.suite import BenchResult
from cbcore.bench.workload import WorkloadError
from cbcore.cli.main import main

SARATHI = Objective.parse("sarathi:tbt=100,start=1,tol=0.05")


class FlipSuite:
    """A fake suite whose row meets the objective exactly up to a planted rate (per seed, for replicates)."""

    def __init__(self, thresholds: dict[int, float]) -> None:
        self.thresholds = thresholds
        self.calls: list[str] = []

    def __call__(self, spec: str, configs: list) -> BenchResult:
        self.calls.append(spec)
        rate, seed = float(spec_value(spec, "rate")), int(spec_value(spec, "seed") or 0)
        below = rate <= self.thresholds[seed]
        row = {"name": configs[0][0], "kind": "simulated", "itl_p99_s": 0.05 if below else 0.2, "queue_p50_s": 0.1,
               "slo_attainment": 0.99 if below else 0.5, "failed": 0, "request_throughput": rate}  # fmt: skip
        return BenchResult(workload={"name": spec}, rows=[row])


def draw(spec: str) -> str:  # the fake suite reads the spec itself
    return spec


@pytest.mark.parametrize("threshold", [0.37, 1.0, 3.7, 150.0])
def test_the_search_finds_a_planted_threshold_within_its_tolerance(threshold: float) -> None:
    suite = FlipSuite({0: threshold})
    result = run_capacity(["poisson:n=10,seed=0"], [("row", None)], suite, draw, [SARATHI], kind="simulated")
    (row,) = result.rows
    (found,) = row["searches"]
    assert found["converged"] and found["censored"] is None
    assert found["capacity"] <= threshold < found["upper"]  # the threshold is bracketed ...
    assert found["upper"] - found["capacity"] <= 0.05 * found["capacity"]  # ... within the tolerance
    assert row["capacity_req_s"] >= threshold * (1 - 0.05)
    assert [v["rate"] for v in found["visited"]] == [float(spec_value(c, "rate")) for c in suite.calls]
    assert all(v["meets"] == (v["rate"] <= threshold) for v in found["visited"])
    assert len(found["visited"]) <= 16


def test_censored_searches_say_so_and_stop() -> None:
    tight = Objective.parse("sarathi:tbt=100,start=1,min_rate=0.25,max_rate=8")
    high = search(lambda r: (True, {}), tight, 1.0)
    assert (high["capacity"], high["upper"], high["censored"]) == (8.0, None, "above max_rate")
    assert [v["rate"] for v in high["visited"]] == [1.0, 2.0, 4.0, 8.0]
    low = search(lambda r: (False, {}), tight, 1.0)
    assert (low["capacity"], low["censored"]) == (0.0, "below min_rate")
    capped = search(lambda r: (r < 3.3, {}), Objective.parse("sarathi:tbt=1,max_runs=4,tol=0.001"), 1.0)
    assert not capped["converged"] and len(capped["visited"]) == 4


def test_replicates_give_a_capacity_per_replicate_and_an_interval() -> None:
    suite = FlipSuite({0: 2.0, 1: 2.5, 2: 3.0})
    specs = ["gamma:n=9,seed=0", "gamma:n=9,seed=1", "gamma:n=9,seed=2"]
    objective = Objective.parse("attainment:p=90,ttft=500,tpot=50,start=1")
    (row,) = run_capacity(specs, [("a", None)], suite, draw, [objective], kind="cbcore").rows
    caps = row["replicate_values"]["capacity_req_s"]
    assert all(t * 0.95 <= c <= t for c, t in zip(caps, (2.0, 2.5, 3.0), strict=True))
    assert row["ci95"]["capacity_req_s"] > 0 and row["capacity_req_s"] == pytest.approx(sum(caps) / 3)
    assert row["slo_attainment_at_capacity"] == pytest.approx(0.99)


def test_objective_specs_are_checked() -> None:
    assert SARATHI.delay == 2000.0 and "median scheduling delay <= 2000 ms" in SARATHI.describe()
    assert Objective.parse("attainment:p=90,ttft=2000,tpot=100").slo().tpot == pytest.approx(0.1)
    ok, measured = SARATHI.check({"itl_p99_s": 0.09, "queue_p50_s": 2.5})
    assert not ok and measured["queue_p50_s"] == 2.5  # TBT met, scheduling delay missed
    for bad, message in (("sarathi:delay=10", "needs tbt"), ("attainment:p=90,ttft=1", "needs p=PCT, ttft=MS and tpot"),
                         ("fast:tbt=1", "kind"), ("sarathi:tbt", "expected KEY=VALUE"), ("sarathi:tbt=-1", "tbt")):  # fmt: skip
        with pytest.raises(WorkloadError, match=message):
            Objective.parse(bad)
    assert rate_spec("poisson:n=4,rate=2", 3.5) == "poisson:n=4,rate=3.5"


def test_cb_simulate_capacity_with_replicates_end_to_end(tmp_path: Path, capsys) -> None:
    out, png = tmp_path / "c.json", tmp_path / "c.png"
    rc = main(["simulate", "--profile", "h200-llama-3-8b", "--no-progress", "--set", "scheduler.budget.max_num_seqs=2",
               "--workload", "poisson:n=24,lengths=fixed,input_len=64,output_len=16,seed=0", "--policy", "fcfs",
               "--capacity", "sarathi:tbt=50,delay=500,start=8,tol=0.1", "--capacity", "sarathi:tbt=50,delay=5000,tol=0.2",
               "--replicates", "2", "--json", str(out), "--plot", str(png)])  # fmt: skip
    assert rc == 0
    table = capsys.readouterr().out
    assert "capacity: the highest arrival rate (req/s) with P99 time between tokens <= 50 ms and median " \
           "scheduling delay <= 500 ms" in table and "delay <= 5000 ms" in table  # fmt: skip
    assert "fcfs [replicate 1]:" in table and "2 replicates" in table
    row, relaxed = json.loads(out.read_text())["rows"]
    assert relaxed["objective_index"] == 1 and relaxed["capacity_req_s"] >= row["capacity_req_s"] * 0.9
    assert row["capacity_req_s"] > 0 and len(row["searches"]) == 2
    for s in row["searches"]:
        assert s["upper"] - s["capacity"] <= 0.1 * s["capacity"]
        assert all(v["queue_p50_s"] <= 0.5 and v["itl_p99_s"] <= 0.05 for v in s["visited"] if v["meets"])
    assert png.read_bytes().startswith(b"\x89PNG")
    assert main(["simulate", "--profile", "h200-llama-3-8b", "--workload", "seed", "--capacity", "sarathi:tbt=5"]) == 2
    assert "needs a workload with a rate= key" in capsys.readouterr().err


def test_cb_bench_capacity_on_the_real_engine(cb_tiny_model_dir, tmp_path: Path) -> None:
    out = tmp_path / "b.json"
    assert main(["bench", "--model", str(cb_tiny_model_dir), "--no-progress", "--policy", "fcfs",
                 "--workload", "poisson:n=4,lengths=fixed,input_len=6,output_len=3,seed=0",
                 "--capacity", "attainment:p=50,ttft=60000,tpot=60000,start=1,max_rate=4", "--json", str(out)]) == 0  # fmt: skip
    (row,) = json.loads(out.read_text())["rows"]
    assert row["kind"] == "cbcore" and row["censored"] == ["above max_rate"] and row["capacity_req_s"] == 4.0
    assert [v["rate"] for v in row["searches"][0]["visited"]] == [1.0, 2.0, 4.0]
