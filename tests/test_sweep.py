"""Load sweeps: one row per value x configuration, the swept value in each row, the sweep figure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cbcore.bench.saturation import saturation_value
from cbcore.bench.sweep import Sweep, with_key
from cbcore.bench.workload import WorkloadError
from cbcore.cli.main import main

PNG = b"\x89PNG\r\n\x1a\n"
# Two priority classes with deadlines; short fixed lengths keep the simulation to a second or two.
BASE = "poisson:n=40,lengths=fixed,input_len=64,output_len=32,priorities=0:1/1:1,deadlines=0:1/1:4,seed=1"
TIGHT = ["--set", "scheduler.budget.max_num_seqs=2"]  # capacity of a few requests per second


def simulate(*args: str) -> int:
    return main(["simulate", "--profile", "h200-llama-3-8b", "--no-progress", *TIGHT, *args])


def test_the_sweep_key_is_replaced_or_added_and_checked() -> None:
    assert with_key("poisson:n=4,rate=2,seed=0", "rate", "5") == "poisson:n=4,rate=5,seed=0"
    assert with_key("gamma:n=4", "rate", "5") == "gamma:n=4,rate=5"
    # the value the spec already has: replaced in place, never given twice
    assert with_key("poisson:n=6,rate=2", "n", "6") == "poisson:n=6,rate=2"
    sweep = Sweep.parse("rate=1, 2,4")
    assert sweep.values == ("1", "2", "4")
    assert sweep.points("poisson:n=3") == ["poisson:n=3,rate=1", "poisson:n=3,rate=2", "poisson:n=3,rate=4"]
    with pytest.raises(WorkloadError, match=r"unknown workload key 'rte' \(did you mean 'rate'\?\)"):
        Sweep.parse("rte=1,2")
    with pytest.raises(WorkloadError, match="expected KEY=V1,V2"):
        Sweep.parse("rate")
    with pytest.raises(WorkloadError, match="a value appears twice"):
        Sweep.parse("rate=1,1")
    with pytest.raises(WorkloadError, match="needs a generator or trace workload"):
        sweep.points("seed")
    assert sweep.points("azure-conv-2023:limit=9") == [f"azure-conv-2023:limit=9,rate={v}" for v in (1, 2, 4)]
    with pytest.raises(WorkloadError, match="rate"):
        Sweep.parse("rate=1,-2").points("poisson:n=3")  # every point is validated before anything runs


def test_cb_simulate_sweeps_rows_json_csv_and_the_figure(tmp_path: Path, capsys) -> None:
    out, csv, png = tmp_path / "s.json", tmp_path / "s.csv", tmp_path / "s.png"
    rc = simulate(
        "--workload", BASE, "--sweep", "rate=1,1000", "--policy", "fcfs", "--policy", "edf-demote",
        "--slo", "ttft:2000,tpot:100", "--json", str(out), "--csv", str(csv), "--plot", str(png),
    )  # fmt: skip
    assert rc == 0
    table = capsys.readouterr().out
    assert "fcfs rate=1 " in table and "edf-demote rate=1000 " in table
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert [(r["config"], r["sweep_value"]) for r in rows] == [
        ("fcfs", 1.0), ("edf-demote", 1.0), ("fcfs", 1000.0), ("edf-demote", 1000.0)
    ]  # fmt: skip
    assert {r["sweep_key"] for r in rows} == {"rate"}
    assert all(r["workload"].endswith(f"rate={r['sweep_value']:g}") for r in rows)
    assert data["workload"]["sweep"]["values"] == [1.0, 1000.0]
    # One request a second is well within capacity; a thousand is far past it.
    assert [r["keeps_up"] for r in rows] == [True, True, False, False]
    assert saturation_value([r for r in rows if r["config"] == "fcfs"]) == 1000.0
    assert all("deadline_attainment" in r and "goodput" in r and "priority" in r["classes"] for r in rows)
    assert csv.read_text().splitlines()[0].count("sweep_value") == 1 and len(csv.read_text().splitlines()) == 5
    assert png.read_bytes().startswith(PNG)


def test_parallel_points_give_the_serial_rows(tmp_path: Path) -> None:
    serial, parallel = tmp_path / "serial.json", tmp_path / "parallel.json"
    args = ["--workload", BASE, "--sweep", "n=10,20", "--policy", "fcfs", "--policy", "edf"]
    assert simulate(*args, "--json", str(serial)) == 0
    assert simulate(*args, "--jobs", "2", "--json", str(parallel)) == 0
    assert json.loads(parallel.read_text())["rows"] == json.loads(serial.read_text())["rows"]


def test_sweep_flag_errors_are_one_line(capsys) -> None:
    assert simulate("--workload", BASE, "--jobs", "2") == 2
    assert "--jobs runs the points of a --sweep" in capsys.readouterr().err
    assert simulate("--workload", "seed", "--sweep", "rate=1,2") == 2
    assert "needs a generator or trace workload" in capsys.readouterr().err
    assert simulate("--workload", BASE, "--sweep", "rate=1,2", "--save-trace", "t.jsonl") == 2
    assert "--save-trace with --sweep" in capsys.readouterr().err


def test_cb_bench_sweeps_on_the_real_engine(cb_tiny_model_dir, tmp_path: Path) -> None:
    out, png = tmp_path / "b.json", tmp_path / "b.png"
    rc = main([
        "bench", "--model", str(cb_tiny_model_dir), "--no-progress", "--no-reference",
        "--workload", "poisson:n=3,rate=inf,lengths=fixed,input_len=6,deadlines=0:60", "--sweep", "output_len=2,4",
        "--policy", "fcfs", "--policy", "edf", "--json", str(out), "--plot", str(png),
    ])  # fmt: skip
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["config"], r["sweep_value"]) for r in rows] == [("fcfs", 2.0), ("edf", 2.0), ("fcfs", 4.0), ("edf", 4.0)]
    assert [r["total_output_tokens"] for r in rows] == [6, 6, 12, 12]
    assert all(r["keeps_up"] is None for r in rows)  # everything at t=0: no rate to keep up with
    assert png.read_bytes().startswith(PNG)
