"""`cb check` on a tiny model directory: matches, forced preemption and chunking, a real divergence."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from cbcore.cli.main import main

PROMPTS = [
    {"prompt": "The capital of France is", "max_new_tokens": 12, "id": "france"},
    {"prompt": "Once upon a time in a land far away,", "max_new_tokens": 30},
    {"messages": [{"role": "user", "content": "Why is the sky blue?"}], "max_new_tokens": 20},
    {"prompt": "café 日本語", "max_new_tokens": 25, "priority": 1, "client_id": "bob"},
    {"prompt": "quantum computing differs from classical computing because", "max_new_tokens": 16},
]

# Attends to every cached key at an earlier position, whatever sequence it belongs to:
# right for one sequence alone, wrong as soon as two share a step.
LEAKY_BACKEND = """
import torch
from cbcore.backends.eager import EagerBackend

class Leaky(EagerBackend):
    name = "leaky"

    def forward(self, query, key, value, layer_idx, batch, kv_cache, scaling, sliding_window):
        k, v = kv_cache.gather(layer_idx, batch.kv_slots)
        allowed = batch.positions[:, None] >= batch.kv_positions[None, :]
        q = query.transpose(0, 1)
        k = k.repeat_interleave(query.shape[1] // k.shape[1], dim=1).transpose(0, 1)
        v = v.repeat_interleave(query.shape[1] // v.shape[1], dim=1).transpose(0, 1)
        scores = (q @ k.transpose(-1, -2)) * scaling
        scores = scores.masked_fill(~allowed, float("-inf"))
        return (torch.softmax(scores, dim=-1) @ v).transpose(0, 1)
"""


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("check") / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_default_config_matches_the_reference(cb_tiny_model_dir, prompts_file, capsys):
    code, out, _ = run_cli(capsys, "check", "--model", str(cb_tiny_model_dir), "--prompts", str(prompts_file))
    assert code == 0, out
    assert "5 identical, 0 near-tie, 0 diverged of 5" in out
    assert re.search(r"france\s+match \(\d+ tokens\)", out)
    assert "line-2" in out  # requests without an id are named by their line


def test_forced_preemption_and_chunking_still_match(cb_tiny_model_dir, prompts_file, capsys):
    code, out, _ = run_cli(
        capsys,
        "check",
        "--model",
        str(cb_tiny_model_dir),
        "--prompts",
        str(prompts_file),
        "--policy",
        "priority+token-budget+chunked+swap",
        "--backend",
        "eager",
        "--set",
        "kv_cache.block_size=4",
        "--set",
        "kv_cache.num_blocks=20",
        "--set",
        "scheduler.budget.max_num_batched_tokens=16",
    )
    assert code == 0, out
    assert "priority+token-budget+chunked-prefill+swap; backend eager; kv 20 blocks of 4" in out
    engine_line = next(line for line in out.splitlines() if line.startswith("engine:"))
    preemptions = int(re.search(r"(\d+) preemptions", engine_line).group(1))
    partial = int(re.search(r"(\d+) partial prefill chunks", engine_line).group(1))
    mixed = int(re.search(r"(\d+) mixed prefill\+decode steps", engine_line).group(1))
    assert preemptions > 0 and partial > 0 and mixed > 0, engine_line


def test_a_real_divergence_fails_with_the_logit_gap(cb_tiny_model_dir, prompts_file, tmp_path, capsys):
    plugin = tmp_path / "leaky.py"
    plugin.write_text(LEAKY_BACKEND)
    code, out, _ = run_cli(
        capsys,
        "check",
        "--model",
        str(cb_tiny_model_dir),
        "--prompts",
        str(prompts_file),
        "--backend",
        f"{plugin}:Leaky",
    )
    assert code == 1
    assert "DIVERGED: first divergence at output token" in out
    gaps = [float(g) for g in re.findall(r"logit gap ([0-9.eE+-]+)", out)]
    assert gaps and max(gaps) > 1e-5


def test_sampled_prompts_and_bad_lines_are_refused(cb_tiny_model_dir, tmp_path, capsys):
    src = tmp_path / "p.jsonl"
    src.write_text(
        json.dumps({"prompt": "hello", "max_new_tokens": 3})
        + "\n"
        + json.dumps({"prompt": "warm", "temperature": 0.7})
        + "\n{oops\n"
    )
    code, out, err = run_cli(capsys, "check", "--model", str(cb_tiny_model_dir), "--prompts", str(src))
    assert code == 1
    assert "1 identical, 0 near-tie, 0 diverged of 1" in out
    assert f"{src}:2: cb check compares greedy decoding" in err
    assert f"{src}:3: not valid JSON" in err


def test_unknown_set_key_is_one_line(capsys):
    code, out, err = run_cli(capsys, "check", "--set", "scheduler.queue.nosuch=1", "--policy", "fcfs")
    assert code == 2 and out == ""
    assert err.startswith("cb: error: ") and err.count("\n") == 1
    assert "scheduler.queue.nosuch: Extra inputs are not permitted" in err
