"""`cb bench --serve` / `--server URL`: the same workload, metrics and reference check, over HTTP."""

from __future__ import annotations

import json

import pytest
from support import SERVE_KEY

from cbcore.cli.main import main

WORKLOAD = "poisson:n=6,rate=20,lengths=fixed,input_len=6,output_len=5,clients=a:1/b:1,seed=0"


def test_bench_drives_a_started_and_a_running_server_with_the_same_trace(
    tiny_server, cb_tiny_model_dir, tmp_path
):
    out = tmp_path / "out.json"
    rc = main(
        [
            "bench", "--model", str(cb_tiny_model_dir), "--no-progress", "--threads", "1",
            "--workload", WORKLOAD, "--policy", "fcfs",
            "--serve", "--server", tiny_server.url, "--api-key", SERVE_KEY,
            "--json", str(out),
        ]
    )  # fmt: skip
    assert rc == 0
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["fcfs", f"http:{tiny_server.url}", "fcfs@http"]
    for row in rows.values():
        assert row["completed"] == 6 and row["total_output_tokens"] == 30
        assert row["identical_to_reference"] is True, row["reference_mismatches"]
        assert row["ttft_p50_s"] > 0 and row["itl_p50_s"] is not None
    assert rows["fcfs@http"]["server"].startswith("http://127.0.0.1:")


def test_the_http_driver_puts_each_field_where_the_server_reads_it() -> None:
    from cbcore.bench.http_driver import request_body, server_dialect
    from cbcore.bench.workload import BenchRequest, Workload

    req = BenchRequest(request_id="r", arrival_s=0.0, max_new_tokens=3, prompt_token_ids=(1, 2), priority=1, client_id="a", deadline_s=2.0,
                       attrs={"tier": "gold"})  # fmt: skip
    cb = request_body("m", req, [1, 2], "cbcore")
    assert (cb["priority"], cb["user"], cb["deadline_s"], cb["attrs"]) == (1, "a", 2.0, {"tier": "gold"})
    vllm = request_body("m", req, [1, 2], "vllm")
    assert vllm["priority"] == 1 and "deadline_s" not in vllm and "attrs" not in vllm
    assert vllm["vllm_xargs"] == {"client_id": "a", "deadline_s": 2.0, "attrs": '{"tier": "gold"}'}
    assert server_dialect("vllm", Workload("w", (req,))) == "vllm"
    with pytest.raises(ValueError, match="no way to receive the workload's attrs, deadline_s, priority"):
        server_dialect("openai", Workload("w", (req,)))
    plain = BenchRequest(request_id="p", arrival_s=0.0, max_new_tokens=3, prompt_token_ids=(1, 2))
    assert server_dialect(None, Workload("w", (plain,))) == "openai"
    assert "priority" not in request_body("m", plain, [1, 2], "openai")


def test_every_http_run_starts_with_the_servers_prefix_cache_empty(tiny_server) -> None:
    """A server keeps its cache between runs: without emptying it, a repeat would find every prompt cached."""
    from cbcore.bench.http_driver import run_http
    from cbcore.bench.workload import BenchRequest, Workload

    reqs = tuple(
        BenchRequest(request_id=f"cold-{i}", arrival_s=0.0, max_new_tokens=2, prompt_token_ids=tuple(range(300 + 40 * i, 340 + 40 * i)), ignore_eos=True)
        for i in range(3)
    )
    for _ in range(2):
        run = run_http(tiny_server.url, "cold", Workload("cold", reqs), [r.prompt_token_ids for r in reqs],
                       api_key=SERVE_KEY)  # fmt: skip
        assert run.info["prefix_cache_kept"] is None
        # 40 tokens: two full blocks of 16 the cache could hold, found in none of them
        assert [(o.metrics.prefix_cache_queries, o.metrics.prefix_cache_hits) for o in run.outputs] == [(40, 0)] * 3
