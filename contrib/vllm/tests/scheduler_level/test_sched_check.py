"""``python -m cbcore_vllm.check --vllm scheduler`` on this vLLM version: agreement, explanation, exit status."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cbcore_vllm.check.__main__ import main
from sched_level import PLUGIN, VERSION
from vllm_trace import STEP_S, trace

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def workload(tmp_path: Path, requests: list[dict]) -> str:
    path = tmp_path / "trace.jsonl"
    lines = [
        {"request_id": r["id"], "arrival_s": r["arrive"] * STEP_S, "prompt_token_ids": r["prompt"],
         "max_new_tokens": r["max_tokens"], "priority": r["priority"], **r["xargs"]}
        for r in requests
    ]  # fmt: skip
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


def config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return str(path)


def check(*args: str) -> int:
    return main([*args, "--vllm", "scheduler"])


def test_contrib_vtc_agrees(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = check("--config", str(EXAMPLES / "vtc.yaml"), "--workload", workload(tmp_path, trace()))
    out = capsys.readouterr().out
    assert rc == 0, out
    assert f"vLLM {VERSION} (scheduler alone, fake model outputs), synchronous" in out
    assert "first-scheduled order (cbcore 8, vLLM 8): agree" in out and "result: the decisions agree" in out


def test_outside_package_under_a_tight_cache_diverges_only_as_documented(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The HRRN + most-slack example, its plugin given by path (the package need not be installed)."""
    plugin = EXAMPLES / "hrrn_slack" / "hrrn_slack.py"
    text = f"plugins: [{plugin}]\n" + (EXAMPLES / "hrrn_slack" / "check.yaml").read_text()
    spec = "poisson:n=12,rate=8,lengths=uniform,input_len=48,output_len=32,clients=alice:2/bob:1,priorities=0:1/1:2,deadlines=0:2/1:6,seed=1"
    rc = check("--config", config(tmp_path, text), "--workload", spec)
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "explained by whole-prompt-reservation" in out  # the tight cache makes vLLM wait for whole prompts
    assert "UNEXPLAINED" not in out and "outputs (cbcore 12, vLLM 12): agree" in out


def test_an_unexplained_divergence_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = f"plugins: [{PLUGIN}]\nscheduler:\n  queue: {{name: engine-dependent}}\n"
    text += "  budget: {name: token-budget, max_num_seqs: 2, max_num_batched_tokens: 64}\n"
    rc = check("--config", config(tmp_path, text), "--workload", workload(tmp_path, trace()))
    out = capsys.readouterr().out
    assert rc == 1, out
    assert "first-scheduled order (cbcore 8, vLLM 8): differ from step" in out
    assert "UNEXPLAINED" in out and "unexplained divergence" in out


def test_bad_input_is_named_with_exit_status_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = "scheduler:\n  queue: {name: fcfs}\nmodel: {dtype: float16}\n"
    assert check("--config", config(tmp_path, text), "--workload", workload(tmp_path, trace())) == 2
    assert "the check reads only plugins, scheduler, kv_cache; remove model" in capsys.readouterr().err
    refused = "scheduler:\n  queue: {name: priority}\n  budget: {name: token-budget, max_num_seqs: 2, max_num_batched_tokens: 64}\n"
    assert check("--config", config(tmp_path, refused), "--workload", workload(tmp_path, trace())) == 2
    assert "RefusedPolicy: queue policy 'priority' (built-in): preemptive admission" in capsys.readouterr().out
