"""`cb bench` end to end on a tiny model directory (random weights, a byte-level tokenizer)."""

from __future__ import annotations

import json

import pytest

from cbcore.cli.main import main

SMALL = "poisson:n=4,rate=inf,lengths=fixed,input_len=6,output_len=5,clients=a:1/b:1,seed=0"
REQUIRED_KEYS = {
    "name",
    "output_tokens_per_s",
    "request_throughput",
    "ttft_p50_s",
    "ttft_p99_s",
    "tpot_p50_s",
    "e2e_p99_s",
    "preemptions",
    "engine_overhead_share",
    "identical_to_reference",
}


@pytest.fixture
def model_dir(cb_tiny_model_dir) -> str:
    return str(cb_tiny_model_dir)


def bench(model_dir: str, *args: str) -> int:
    return main(["bench", "--model", model_dir, "--no-progress", *args])


def test_policies_times_backends_plus_baselines_in_one_run(model_dir, tmp_path, capsys) -> None:
    out = tmp_path / "out.json"
    csv = tmp_path / "out.csv"
    trace = tmp_path / "trace.jsonl"
    rc = bench(
        model_dir,
        "--workload", SMALL,
        "--policy", "fcfs",
        "--policy", "priority+whole",
        "--backend", "eager",
        "--baseline", "hf-static",
        "--baseline", "hf-generate-batch",
        "--batch-size", "2",
        "--slo", "ttft:60000,tpot:60000",
        "--json", str(out),
        "--csv", str(csv),
        "--save-trace", str(trace),
    )  # fmt: skip
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["workload"]["num_requests"] == 4
    names = [r["name"] for r in data["rows"]]
    assert names == ["fcfs/eager", "priority+whole/eager", "hf-static", "hf-generate-batch"]
    for row in data["rows"]:
        assert row.keys() >= REQUIRED_KEYS
        assert row["completed"] == 4
        assert row["total_output_tokens"] == 20  # ignore_eos: every request runs to its cap
        assert row["goodput"] == pytest.approx(row["request_throughput"])
        # Tiny fp32 model, greedy: every row must match the per-prompt reference.
        assert row["identical_to_reference"] is True, row["reference_mismatches"]
    ours = data["rows"][0]
    assert ours["kind"] == "cbcore" and ours["steps"] > 0
    assert 0 <= ours["engine_overhead_share"] < 1
    assert ours["clients"].keys() == {"a", "b"}
    assert data["rows"][2]["waves"] == 2  # four requests in waves of two
    assert set(data["speedups"]) == {"hf-static", "hf-generate-batch"}
    header = csv.read_text().splitlines()[0].split(",")
    assert header[0] == "name" and "output_tokens_per_s" in header
    assert len(csv.read_text().splitlines()) == 5
    table = capsys.readouterr().out
    assert "fcfs/eager" in table and "hf-generate-batch" in table and "x output tokens/s" in table

    # The saved trace replays the same requests.
    out2 = tmp_path / "replay.json"
    assert bench(model_dir, "--workload", str(trace), "--backend", "eager", "--json", str(out2)) == 0
    replay = json.loads(out2.read_text())
    assert replay["rows"][0]["name"] == "eager"
    assert replay["rows"][0]["total_output_tokens"] == 20
    assert replay["rows"][0]["total_input_tokens"] == ours["total_input_tokens"]


def test_config_files_are_rows_and_plot_is_written(model_dir, tmp_path) -> None:
    a = tmp_path / "small.yaml"
    a.write_text(
        "backend: {name: eager}\n"
        "scheduler:\n  budget: {name: token-budget, max_num_seqs: 2, max_num_batched_tokens: 64}\n"
    )
    b = tmp_path / "static.yaml"
    b.write_text("backend: {name: eager}\nscheduler:\n  budget: {name: static, max_num_seqs: 2}\n")
    png = tmp_path / "plot.png"
    out = tmp_path / "out.json"
    rc = bench(
        model_dir, "--workload", SMALL, "--config", str(a), "--config", str(b),
        "--no-reference", "--plot", str(png), "--json", str(out), "--repeat", "2",
        "--baseline", "hf-generate-batch",
    )  # fmt: skip
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    baseline = rows.pop()  # gets the largest limits among the configurations (static: 8192 tokens)
    assert (baseline["name"], baseline["batch_size"], baseline["max_batch_tokens"]) == (
        "hf-generate-batch",
        2,
        8192,
    )
    assert [r["name"] for r in rows] == ["small", "static"]
    assert [r["max_num_seqs"] for r in rows] == [2, 2]
    assert all(r["max_seqs_per_step"] <= 2 for r in rows)
    assert all(r["identical_to_reference"] is None for r in rows)
    assert all(r["repeats"] == 2 and len(r["duration_s_all"]) == 2 for r in rows)
    assert all(r["duration_s"] in r["duration_s_all"] for r in rows)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_trace_fails_with_its_line_number(model_dir, tmp_path, capsys) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text(
        '{"arrival_s": 0, "prompt_token_ids": [5], "max_new_tokens": 2}\n'
        '{"arrival_s": -1, "prompt_token_ids": [5], "max_new_tokens": 2}\n'
    )
    assert bench(model_dir, "--workload", str(trace), "--backend", "eager") == 2
    err = capsys.readouterr().err
    assert f"{trace}:2: arrival_s" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--slo", "ttft"], "--slo 'ttft'"),
        (["--policy", "nonsense"], "unknown policy 'nonsense'"),
        (["--workload", "poisson:n=0"], "n: Input should be greater than or equal to 1"),
        (["--batch-size", "0"], "--batch-size must be >= 1"),
        (["--repeat", "0"], "--repeat must be >= 1"),
    ],
)
def test_bad_flags_fail_in_one_line(model_dir, capsys, args: list[str], message: str) -> None:
    assert bench(model_dir, "--backend", "eager", *args) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_help_lists_the_workload_forms(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = capsys.readouterr().out
    for flag in (
        "--workload",
        "--policy",
        "--backend",
        "--config",
        "--baseline",
        "--slo",
        "--json",
        "--plot",
    ):
        assert flag in text
    assert "poisson:n=64,rate=2,lengths=sharegpt,seed=0" in text


def test_ignore_eos_runs_to_the_cap_in_reference_and_baselines() -> None:
    """A model whose first greedy token is its EOS: ignore_eos must still give the full cap everywhere."""
    import torch

    from cbcore.bench.baselines import run_hf_generate_batch, run_hf_static
    from cbcore.bench.suite import reference_outputs
    from cbcore.bench.workload import BenchRequest, Workload
    from cbcore.testing import tiny_model

    model = tiny_model("llama")
    prompt = [5, 17, 42, 99]
    with torch.inference_mode():
        first = int(model(input_ids=torch.tensor([prompt])).logits[0, -1].argmax())
    model.generation_config.eos_token_id = first
    model.config.eos_token_id = first
    reqs = [
        BenchRequest(request_id="stop", arrival_s=0.0, max_new_tokens=6, prompt_token_ids=tuple(prompt)),
        BenchRequest(request_id="go-on", arrival_s=0.0, max_new_tokens=6, prompt_token_ids=tuple(prompt), ignore_eos=True),
    ]
    work = Workload("eos", tuple(reqs))
    ids = [prompt, prompt]
    refs = reference_outputs(model, work, ids)
    assert refs[0].token_ids == [first]  # stops at its EOS
    assert len(refs[1].token_ids) == 6 and refs[1].token_ids[0] == first  # emits EOS and goes on
    for run in (
        run_hf_static(model, work, ids, batch_size=2),
        run_hf_generate_batch(model, work, ids, batch_size=2),
    ):
        assert [o.output_token_ids for o in run.outputs] == [r.token_ids for r in refs], run.name
        assert [o.finish_reason for o in run.outputs] == ["stop", "length"]


BROKEN_POLICY = """
from cbcore import BudgetPolicy, hookimpl


class Broken(BudgetPolicy):
    name = "broken-budget"

    def limits(self, state):  # concerns no single request: the engine stops, the row fails
        raise RuntimeError("no budget today")


@hookimpl
def cbcore_register_policies():
    return [Broken]
"""


def test_a_failing_row_is_reported_and_the_others_run_with_per_class_results(model_dir, tmp_path, capsys) -> None:
    (tmp_path / "broken.py").write_text(BROKEN_POLICY)
    config = tmp_path / "broken.yaml"
    config.write_text("plugins: [./broken.py]\nscheduler:\n  budget: {name: broken-budget}\nbackend: {name: eager}\n")
    good = tmp_path / "good.yaml"
    good.write_text("backend: {name: eager}\n")
    out = tmp_path / "out.json"
    plot = tmp_path / "out.png"
    workload = (
        "poisson:n=6,rate=inf,lengths=fixed,input_len=6,output_len=4,clients=a:1/b:1,"
        "priorities=0:1/1:1,deadlines=0:0.001/1:600,seed=3"
    )
    rc = bench(
        model_dir, "--workload", workload, "--config", str(config), "--config", str(good),
        "--slo", "ttft:60000", "--json", str(out), "--plot", str(plot),
    )
    text = capsys.readouterr().out
    assert rc == 1  # a row failed
    assert "broken: FAILED: PolicyError: budget policy 'broken-budget'" in text and "raised in limits()" in text
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows["broken"]) == {"name", "kind", "error"}
    row = rows["good"]
    assert row["completed"] == 6 and row["identical_to_reference"] is True
    assert set(row["classes"]) == {"priority", "client_id"}
    urgent, relaxed = row["classes"]["priority"]["0"], row["classes"]["priority"]["1"]
    assert urgent["deadline_attainment"] == 0.0  # 1 ms deadlines cannot be met
    assert relaxed["deadline_attainment"] == 1.0 and relaxed["slo_attainment"] == 1.0
    assert urgent["requests"] + relaxed["requests"] == 6 and urgent["ttft_p50_s"] is not None
    assert 0 < row["deadline_attainment"] < 1
    assert "good  priority=0:" in text and "deadline 0% of" in text
    assert plot.stat().st_size > 0
