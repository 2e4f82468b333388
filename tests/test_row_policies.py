"""Rows with their own policy parameters: `--policy 'NAME=sjf(aging_s=0.5)+chunked'`, `@FILE`, and refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cbcore.cli.common import policy_params, scheduler_from_mix, split_top
from cbcore.cli.main import main
from cbcore.plugins import PluginError

WORKLOAD = "poisson:n=8,rate=20,lengths=fixed,input_len=32,output_len=4"


def simulate(*args: str) -> int:
    return main(["simulate", "--profile", "h200-llama-3-8b", "--no-progress", "--workload", WORKLOAD, *args])


def test_a_mix_carries_each_policys_parameters_and_the_phase_order() -> None:
    assert split_top('a(x=1,y=[2,3])+b(z="p+q")', "+") == ["a(x=1,y=[2,3])", 'b(z="p+q")']
    assert policy_params("m", 'vtc(weights={"a": 2, "b": 1},output_weight=2)') == (
        "vtc", {"weights": {"a": 2, "b": 1}, "output_weight": 2}
    )  # fmt: skip
    assert scheduler_from_mix("priority(aging_s=0.5)+chunked(chunk_size=512)+recompute(victim=least-progress)") == {
        "queue": {"name": "priority", "aging_s": 0.5},
        "prefill": {"name": "chunked-prefill", "chunk_size": 512},
        "preemption": {"name": "recompute", "victim": "least-progress"},
    }
    assert scheduler_from_mix("whole+prefill-first") == {"prefill": {"name": "whole-prompt"}, "order": "prefill-first"}
    with pytest.raises(PluginError, match="expected NAME\\(KEY=VALUE"):
        scheduler_from_mix("priority(aging_s=1")
    with pytest.raises(PluginError, match="two phase orders"):
        scheduler_from_mix("decode-first+prefill-first")


def test_rows_named_with_their_own_parameters_and_a_config_file(tmp_path: Path) -> None:
    section = tmp_path / "mine.yaml"
    section.write_text("scheduler:\n  queue: {name: priority, aging_s: 2}\n  prefill: {name: chunked-prefill, chunk_size: 16}\n")
    out = tmp_path / "rows.json"
    assert simulate("--policy", "base=whole+prefill-first", "--policy", "priority(aging_s=0.5)+chunked(chunk_size=8)",
                    "--policy", f"@{section}", "--json", str(out)) == 0  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert [r["name"] for r in rows] == ["base", "priority(aging_s=0.5)+chunked(chunk_size=8)", "mine"]
    assert rows[0]["scheduler"] == {"prefill": {"name": "whole-prompt"}, "order": "prefill-first"}
    assert rows[1]["scheduler"]["queue"] == {"name": "priority", "aging_s": 0.5}
    assert rows[2]["scheduler"]["prefill"] == {"name": "chunked-prefill", "chunk_size": 16}


def test_a_refused_parameter_names_the_row_and_the_policy(capsys) -> None:
    assert simulate("--policy", "fcfs", "--policy", "late=priority(aging_s=soon)") == 2
    err = capsys.readouterr().err.strip()
    assert err == "cb: error: row 'late': queue policy 'priority': scheduler.queue.aging_s: Input should be a valid number"
    # --set applies to every row: the first row it does not fit is named, with its policy.
    assert simulate("--policy", "priority", "--policy", "fcfs", "--set", "scheduler.queue.aging_s=1") == 2
    assert "row 'fcfs': queue policy 'fcfs': scheduler.queue.aging_s: Extra inputs" in capsys.readouterr().err
