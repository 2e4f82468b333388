"""What the reports say about requests that did not complete, evictions and late deadlines, per row and class."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cbcore.bench.classes import deadline_stats
from cbcore.bench.metrics import failure_reasons
from cbcore.bench.workload import BenchRequest
from cbcore.cli.main import main
from cbcore.outputs import RequestMetrics, RequestOutput

# 40 blocks of 16 tokens: some drawn requests (prompt + max_new_tokens > 640) can never fit the cache.
TIGHT = ["--set", "kv_cache.num_blocks=40", "--set", "kv_cache.block_size=16"]
WORKLOAD = "poisson:n=30,rate=5,lengths=uniform,input_len=300,output_len=300,priorities=0:1/1:1,deadlines=0:3/1:30,seed=1"


def test_a_request_that_can_never_fit_is_named_with_its_reason_in_table_json_and_log(tmp_path: Path, capsys) -> None:
    out = tmp_path / "f.json"
    assert main(["simulate", "--profile", "h200-llama-3-8b", "--no-progress", *TIGHT, "--workload", WORKLOAD,
                 "--policy", "fcfs", "--json", str(out)]) == 0  # fmt: skip
    captured = capsys.readouterr()
    header, _, row = captured.out.splitlines()[1:4]
    end = header.index(" failed") + len(" failed")  # columns are right-aligned under their header
    assert row[:end].split()[-1] == "10"  # the failed column, in the table itself
    reason = "the prompt's 387 tokens + max_new_tokens 281 needs KV for 667 tokens but the whole cache holds 640"
    assert f"fcfs: 10 request(s) did not complete: request r7: {reason}" in captured.out
    assert "[r7, r9, r12," in captured.out
    assert "requests did not complete" in captured.err and "r7" in captured.err  # the log says it too
    data = json.loads(out.read_text())["rows"][0]
    assert data["failed"] == 10 and data["completed"] == 20
    (failure,) = data["failures"]
    assert failure["count"] == 10 and failure["requests"][0] == "r7" and reason in failure["example"]
    assert "N tokens + max_new_tokens N" in failure["reason"]  # numbers and ids out: one reason for all ten
    classes = data["classes"]["priority"]
    assert sum(c["failed"] for c in classes.values()) == 10
    assert sum(c["preemptions"] for c in classes.values()) == data["preemptions"] > 0
    assert classes["0"]["deadline_missed"] > 0 and classes["0"]["lateness_max_s"] > 0
    assert "evicted=" in captured.out and "late p50/max" in captured.out


def _out(rid: str, e2e: float | None, error: str | None = None) -> RequestOutput:
    if e2e is None:
        return RequestOutput.rejected(rid, [1], error or "refused")
    m = RequestMetrics(0.0, 0.0, 0.1, (0.1, e2e), e2e, 2, 1, 2)
    return RequestOutput(rid, [1], [0, 0], [], True, "length", metrics=m)


def test_reasons_group_by_text_without_ids_and_numbers_and_lateness_is_measured() -> None:
    outs = [_out("a", 1.0), _out("b", None, "request b: the prompt has 90 tokens"),
            _out("c", None, "request c: the prompt has 120 tokens"), _out("d", None, "request d: boom")]  # fmt: skip
    reasons = failure_reasons(outs)
    assert [(r["reason"], r["count"], r["requests"]) for r in reasons] == [
        ("the prompt has N tokens", 2, ["b", "c"]), ("boom", 1, ["d"])
    ]  # fmt: skip
    reqs = [BenchRequest(request_id=r, arrival_s=0.0, max_new_tokens=2, prompt_token_ids=(1,), deadline_s=d)
            for r, d in (("a", 0.5), ("b", 0.5), ("c", None), ("d", 2.0))]  # fmt: skip
    stats = deadline_stats(reqs, [_out("a", 1.0), _out("b", None), _out("c", 3.0), _out("d", 1.5)])
    assert stats["deadline_missed"] == 2 and stats["deadline_missed_failed"] == 1
    assert stats["lateness_max_s"] == pytest.approx(0.5) and stats["deadline_attainment"] == pytest.approx(1 / 3)
