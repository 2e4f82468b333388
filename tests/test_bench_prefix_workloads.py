"""Workloads that repeat themselves: shared system prompts and closed-loop multi-turn conversations."""

from __future__ import annotations

import json

import pytest

from cbcore.bench.arrivals import Arrivals, prompt_bounds
from cbcore.bench.generator import generate
from cbcore.bench.workload import BenchRequest, Workload, WorkloadError, parse_trace
from cbcore.cli.main import main
from cbcore.outputs import RequestOutput

CHAT = "poisson:n=3,rate=inf,lengths=fixed,input_len=6,output_len=4,turns=3,think_s=0.5,system_len=9,seed=1"


def test_a_system_prompt_starts_every_prompt_and_one_turn_changes_nothing():
    plain = generate("poisson:n=6,rate=2,lengths=uniform,seed=3", 500)
    shared = generate("poisson:n=6,rate=2,lengths=uniform,seed=3,system_len=12,system_prompts=2,clients=a/b", 500)
    assert generate("poisson:n=6,rate=2,lengths=uniform,seed=3,turns=1", 500).requests == plain.requests
    by_client: dict[str, tuple[int, ...]] = {}
    for req, alone in zip(shared.requests, plain.requests, strict=True):
        head = req.prompt_token_ids[:12]
        assert by_client.setdefault(req.client_id, head) == head
        assert req.prompt_token_ids[12:] == alone.prompt_token_ids  # the same user part after it
    assert len(set(by_client.values())) == 2


def test_turns_follow_each_other_with_a_think_time():
    workload = generate(CHAT, 500)
    assert [r.request_id for r in workload.requests] == ["r0", "r0.1", "r0.2", "r1", "r1.1", "r1.2", "r2", "r2.1", "r2.2"]
    assert [r.follows for r in workload.requests[:3]] == [None, "r0", "r0.1"]
    assert [r.arrival_s for r in workload.requests[:3]] == [0.0, 0.5, 0.5]
    assert [len(r.prompt_token_ids) for r in workload.requests[:3]] == [15, 6, 6]  # system prompt on turn 0
    assert workload.is_closed_loop and workload.describe()["follow_ups"] == 6
    assert prompt_bounds(workload.requests, [r.prompt_token_ids for r in workload.requests])[:3] == [15, 25, 35]
    again = Workload("t", tuple(parse_trace([json.dumps(r.to_json()) for r in workload.requests])))
    assert [r.follows for r in again.requests] == [r.follows for r in workload.requests]


def test_a_follow_up_must_name_an_earlier_request():
    first = BenchRequest(request_id="a", arrival_s=0.0, max_new_tokens=2, prompt_token_ids=(1, 2))
    with pytest.raises(WorkloadError, match="'b' follows 'zzz', which is not an earlier request"):
        Workload("w", (first, BenchRequest(request_id="b", arrival_s=0.1, max_new_tokens=2, prompt_token_ids=(3,), follows="zzz")))


def test_arrivals_release_a_turn_think_time_after_the_answer_with_the_whole_history():
    reqs = (
        BenchRequest(request_id="a", arrival_s=1.0, max_new_tokens=2, prompt_token_ids=(1, 2)),
        BenchRequest(request_id="b", arrival_s=0.5, max_new_tokens=2, prompt_token_ids=(7,), follows="a"),
    )
    arrivals = Arrivals(reqs, start=100.0, token_ids=[[1, 2], [7]])
    assert list(arrivals.due(100.9)) == []
    assert list(arrivals.due(101.0)) == [0]
    assert arrivals.next_time() is None and not arrivals.exhausted  # b waits on a, in flight
    answer = RequestOutput("a", [1, 2], [5, 6], [], True, "length")
    arrivals.finished(0, answer, now=103.0)
    assert arrivals.next_time() == 103.5 and list(arrivals.due(103.4)) == []
    assert list(arrivals.due(103.5)) == [1]
    assert arrivals.prompt(1) == [1, 2, 5, 6, 7] and arrivals.arrival_time(1) == 103.5
    assert arrivals.exhausted


def test_closed_loop_bench_rows_are_exact_and_the_cache_serves_the_history(cb_tiny_model_dir, tmp_path):
    out = tmp_path / "out.json"
    off = tmp_path / "off.yaml"
    off.write_text("kv_cache:\n  prefix_caching: false\n")
    on = tmp_path / "on.yaml"
    on.write_text("kv_cache:\n  prefix_caching: true\n  block_size: 4\n")
    rc = main(
        ["bench", "--model", str(cb_tiny_model_dir), "--no-progress", "--workload", CHAT, "--config", str(off),
         "--config", str(on), "--baseline", "hf-static", "--baseline", "hf-generate-batch", "--json", str(out)]
    )  # fmt: skip
    assert rc == 0
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    assert all(r["identical_to_reference"] is True and r["completed"] == 9 for r in rows.values()), rows
    assert rows["off"]["prefix_cache_hit_rate"] is None
    # Turn k+1 finds turn k's prompt and most of its answer cached; the system prompt is shared.
    assert rows["on"]["prefix_cache_hit_rate"] > 0.4
