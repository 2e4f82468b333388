"""Replicates: one spec per replicate, rows averaged with 95 % intervals, pairs compared, end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cbcore.bench.replicates import aggregate, combine, differences, replicate_spec, replicate_specs
from cbcore.bench.stats import mean_interval
from cbcore.bench.suite import BenchResult
from cbcore.bench.workload import WorkloadError
from cbcore.cli.main import main

BASE = "poisson:n=30,rate=4,lengths=fixed,input_len=64,output_len=24,seed=3"


def simulate(*args: str) -> int:
    return main(["simulate", "--profile", "h200-llama-3-8b", "--no-progress", "--set",
                 "scheduler.budget.max_num_seqs=2", *args])  # fmt: skip


def test_generators_redraw_with_the_next_seed_and_traces_take_the_next_window(tmp_path: Path) -> None:
    assert replicate_specs("poisson:n=4,seed=3", 3) == ["poisson:n=4,seed=3", "poisson:n=4,seed=4", "poisson:n=4,seed=5"]
    assert replicate_spec("gamma:n=4", 2) == "gamma:n=4,seed=2"  # the default seed is 0
    trace = "trace:path=t.csv,rate=2,start_s=60,duration_s=600"
    assert replicate_specs(trace, 3) == [trace, trace.replace("start_s=60", "start_s=660"),
                                         trace.replace("start_s=60", "start_s=1260")]  # fmt: skip
    assert replicate_spec("azure-conv-2023:duration_s=300", 1) == "azure-conv-2023:duration_s=300,start_s=300"
    with pytest.raises(WorkloadError, match="needs duration_s=D"):
        replicate_spec("trace:path=t.csv,rate=2", 1)
    with pytest.raises(WorkloadError, match="replays the same requests every time"):
        replicate_spec("seed", 1)
    saved = tmp_path / "w.jsonl"
    saved.write_text("")
    with pytest.raises(WorkloadError, match="replays the same requests"):
        replicate_spec(str(saved), 1)
    with pytest.raises(WorkloadError, match="seed 'x' is not an integer"):
        replicate_spec("poisson:seed=x", 1)
    with pytest.raises(WorkloadError, match="at least 1"):
        replicate_specs(BASE, 0)


def test_aggregate_averages_numbers_nested_classes_and_flags() -> None:
    runs = [
        {"name": "a", "x": 1.0, "n": 4, "gone": None, "ok": True, "scheduler": {"queue": "fcfs"},
         "classes": {"priority": {"0": {"ttft_p50_s": 0.1}, "1": {"ttft_p50_s": 0.3}}}, "clients": {"c": {"served": 10}}},
        {"name": "a", "x": 3.0, "n": 6, "gone": 2.0, "ok": False, "scheduler": {"queue": "fcfs"},
         "classes": {"priority": {"0": {"ttft_p50_s": 0.3}, "1": {"ttft_p50_s": 0.5}}}, "clients": {"c": {"served": 20}}},
    ]  # fmt: skip
    row = aggregate(runs)
    assert (row["x"], row["n"], row["gone"], row["ok"]) == (2.0, 5.0, 2.0, False)
    assert row["ci95"]["x"] == pytest.approx(mean_interval([1.0, 3.0]).half_width)
    assert row["ci95"]["gone"] is None  # one replicate had it: no spread known
    assert row["replicate_values"]["x"] == [1.0, 3.0]
    assert row["scheduler"] == {"queue": "fcfs"}  # configuration, not a metric: kept as is
    assert row["classes"]["priority"]["1"]["ttft_p50_s"] == pytest.approx(0.4)
    assert row["classes"]["priority"]["1"]["ci95"]["ttft_p50_s"] > 0
    assert row["clients"]["c"]["served"] == 15.0


def _result(rows: list[dict]) -> BenchResult:
    return BenchResult(workload={"name": "w", "num_requests": 3, "arrival_span_s": 1.0},
                       rows=rows, samples={r["name"]: {"ttft": [r["ttft_p99_s"]]} for r in rows})  # fmt: skip


def test_combine_compares_rows_replicate_by_replicate_and_names_a_failed_replicate() -> None:
    # Row "slow" has a TTFT p99 0.1 s above "fast" in every replicate, over replicate noise of +-1 s.
    noise = [0.0, 1.0, -1.0, 0.5]
    results = [
        _result([{"name": "fast", "kind": "simulated", "ttft_p99_s": 2 + e, "failures": []},
                 {"name": "slow", "kind": "simulated", "ttft_p99_s": 2.1 + e, "failures": []},
                 {"name": "same", "kind": "simulated", "ttft_p99_s": 2 + e + (0.05 if i % 2 else -0.05),
                  "failures": [{"reason": "r", "count": 1, "requests": ["x"], "example": "r"}]}])
        for i, e in enumerate(noise)
    ]  # fmt: skip
    specs = [replicate_spec(BASE, i) for i in range(4)]
    out = combine(results, specs)
    rows = {r["name"]: r for r in out.rows}
    assert rows["slow"]["ttft_p99_s"] == pytest.approx(2.225)
    assert rows["slow"]["ci95"]["ttft_p99_s"] > 0.5  # the rows' own intervals overlap ...
    differ = out.workload["replicates"]["differences"]
    assert differ["pairs"] == 3
    found = {(d["a"], d["b"]) for d in differ["differ"]}
    assert ("fast", "slow") in found and ("fast", "same") not in found  # ... the paired difference does not
    assert rows["same"]["failures"][0]["count"] == 4 and rows["same"]["failures"][0]["requests"][1] == "x (replicate 1)"
    assert out.workload["replicates"]["specs"] == specs and "seeds 3..6" in out.workload["replicates"]["method"]
    assert len(out.replicate_samples["fast"]) == 4 and len(out.samples["fast"]["ttft"]) == 4
    results[2].rows[1] = {"name": "slow", "kind": "simulated", "error": "boom"}
    failed = {r["name"]: r for r in combine(results, specs).rows}["slow"]
    assert failed["error"] == f"replicate 2 ({specs[2]}): boom"
    assert differences([failed]) == {"pairs": 0, "differ": []}


def test_cb_simulate_replicates_are_the_runs_of_each_seed_averaged(tmp_path: Path, capsys) -> None:
    out = tmp_path / "r.json"
    assert simulate("--workload", BASE, "--policy", "fcfs", "--policy", "sjf", "--replicates", "3",
                    "--json", str(out), "--plot", str(tmp_path / "r.png")) == 0  # fmt: skip
    table = capsys.readouterr().out
    assert "3 replicates: the generator redrew arrivals, lengths and prompts with seeds 3..5" in table
    assert " ± " in table and "differences beyond the 95 % intervals" in table
    data = json.loads(out.read_text())
    fcfs = data["rows"][0]
    assert fcfs["replicates"] == 3 and fcfs["ci95"]["ttft_p99_s"] is not None
    singles = []
    for seed in (3, 4, 5):
        one = tmp_path / f"s{seed}.json"
        assert simulate("--workload", BASE.replace("seed=3", f"seed={seed}"), "--policy", "fcfs", "--json", str(one)) == 0
        singles.append(json.loads(one.read_text())["rows"][0])
    assert fcfs["replicate_values"]["ttft_p99_s"] == [s["ttft_p99_s"] for s in singles]
    assert fcfs["ttft_p99_s"] == pytest.approx(sum(s["ttft_p99_s"] for s in singles) / 3)
    parallel = tmp_path / "p.json"
    assert simulate("--workload", BASE, "--policy", "fcfs", "--policy", "sjf", "--replicates", "3", "--jobs", "2",
                    "--json", str(parallel)) == 0  # fmt: skip
    assert json.loads(parallel.read_text())["rows"] == data["rows"]


def test_replicates_of_a_sweep_and_flag_errors(tmp_path: Path, capsys) -> None:
    out = tmp_path / "s.json"
    assert simulate("--workload", BASE, "--policy", "fcfs", "--sweep", "rate=2,50", "--replicates", "2",
                    "--json", str(out), "--plot", str(tmp_path / "s.png")) == 0  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert [(r["name"], r["replicates"]) for r in rows] == [("fcfs rate=2", 2), ("fcfs rate=50", 2)]
    assert rows[0]["keeps_up"] is True and rows[1]["keeps_up"] is False
    assert simulate("--workload", "seed", "--replicates", "2") == 2
    assert "replays the same requests every time" in capsys.readouterr().err
    assert simulate("--workload", BASE, "--replicates", "2", "--save-trace", str(tmp_path / "t.jsonl")) == 2
    assert "--save-trace with --replicates" in capsys.readouterr().err


def test_cb_bench_replicates_on_the_real_engine(cb_tiny_model_dir, tmp_path: Path) -> None:
    out = tmp_path / "b.json"
    assert main(["bench", "--model", str(cb_tiny_model_dir), "--no-progress", "--no-reference", "--policy", "fcfs",
                 "--workload", "poisson:n=3,rate=inf,lengths=uniform,input_len=6,output_len=3,seed=0",
                 "--replicates", "2", "--json", str(out)]) == 0  # fmt: skip
    row = json.loads(out.read_text())["rows"][0]
    assert row["replicates"] == 2 and len(row["replicate_values"]["total_output_tokens"]) == 2
