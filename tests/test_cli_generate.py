"""`cb generate` on a tiny model directory: JSONL in and out, streaming, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from cbcore.cli.main import main
from cbcore.cli.stream_util import OrderedStream
from cbcore.models.detokenize import IncrementalDetokenizer
from cbcore.testing import reference_generate
from cbcore.testing.tiny_tokenizer import tiny_tokenizer


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def records(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines()]


def write_jsonl(path: Path, *lines: object) -> Path:
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


def test_prompts_give_the_per_prompt_reference_tokens(cb_tiny_model_dir, capsys):
    code, out, _ = run_cli(
        capsys,
        "generate",
        "--model",
        str(cb_tiny_model_dir),
        "The capital of France is",
        "café 日本",
        "--max-new-tokens",
        "7",
    )
    assert code == 0
    got = records(out)
    assert [r["id"] for r in got] == ["prompt-1", "prompt-2"]
    model = AutoModelForCausalLM.from_pretrained(cb_tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(cb_tiny_model_dir)
    prompts = [tok.encode("The capital of France is"), tok.encode("café 日本")]
    refs = reference_generate(model, prompts, 7)
    for rec, ref, prompt in zip(got, refs, prompts, strict=True):
        assert rec["token_ids"] == ref.token_ids
        assert rec["prompt_tokens"] == len(prompt)
        assert rec["text"] == tok.decode(ref.token_ids, skip_special_tokens=True)
        assert rec["finish_reason"] in ("length", "stop")


def test_jsonl_input_chat_template_and_per_request_params(cb_tiny_model_dir, tmp_path, capsys):
    messages = [{"role": "user", "content": "Hi there"}]
    src = write_jsonl(
        tmp_path / "in.jsonl",
        {"prompt": "Once upon a time", "max_new_tokens": 3, "id": "plain"},
        "",
        {"messages": messages, "max_new_tokens": 5, "priority": 1, "client_id": "bob"},
        {"prompt": "Once upon a time", "temperature": 0.9, "top_k": 50, "seed": 7, "id": "s1"},
        {"prompt": "Once upon a time", "temperature": 0.9, "top_k": 50, "seed": 7, "id": "s2"},
    )
    out_file = tmp_path / "out.jsonl"
    code, out, _ = run_cli(
        capsys,
        "generate",
        "--model",
        str(cb_tiny_model_dir),
        "-i",
        str(src),
        "-o",
        str(out_file),
        "--max-new-tokens",
        "6",
    )
    assert code == 0 and out == ""
    got = {r["id"]: r for r in records(out_file.read_text())}
    assert sorted(got) == ["line-3", "plain", "s1", "s2"]  # lines in completion order; default ids name the line
    assert got["plain"]["output_tokens"] == 3 or got["plain"]["finish_reason"] == "stop"
    tok = AutoTokenizer.from_pretrained(cb_tiny_model_dir)
    templated = tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert got["line-3"]["prompt_tokens"] == len(templated)
    # Each request owns its generator: the same seed gives the same sample whatever else ran.
    assert got["s1"]["token_ids"] == got["s2"]["token_ids"]


def test_malformed_lines_are_reported_by_number_and_the_rest_still_runs(cb_tiny_model_dir, tmp_path, capsys):
    src = write_jsonl(
        tmp_path / "in.jsonl",
        {"prompt": "good one", "max_new_tokens": 2},
        '{"prompt": "broken',
        {"prompt": "typo", "max_tokens": 3},
        {"prompt": "greedy", "top_k": 5},
        {"prompt": "good two", "max_new_tokens": 2},
        {"prompt": "x", "messages": [{"role": "user", "content": "y"}]},
        [1, 2],
    )
    code, out, err = run_cli(capsys, "generate", "--model", str(cb_tiny_model_dir), "--input", str(src))
    assert code == 1
    assert [r["id"] for r in records(out)] == ["line-1", "line-5"]
    lines = err.strip().splitlines()
    assert len(lines) == 5
    assert all(line.startswith(f"cb: error: {src}:") for line in lines)
    assert f"{src}:2: not valid JSON" in err
    assert f"{src}:3: max_tokens: Extra inputs are not permitted" in err
    assert f"{src}:4: top_k/top_p only apply when temperature >= 1e-05" in err
    assert f"{src}:6: give exactly one of 'prompt' or 'messages'" in err
    assert f"{src}:7: expected a JSON object" in err
    assert "Traceback" not in err


def test_stream_prints_the_texts_in_order(cb_tiny_model_dir, capsys):
    code, out, _ = run_cli(
        capsys,
        "generate",
        "--model",
        str(cb_tiny_model_dir),
        "--stream",
        "hello",
        "café 日本",
        "--max-new-tokens",
        "9",
    )
    assert code == 0
    code, plain, _ = run_cli(
        capsys, "generate", "--model", str(cb_tiny_model_dir), "hello", "café 日本", "--max-new-tokens", "9"
    )
    texts = [r["text"] for r in records(plain)]
    assert out == f"[prompt-1] {texts[0]}\n[prompt-2] {texts[1]}\n"


def test_incremental_detokenizer_handles_multibyte_characters():
    tok = tiny_tokenizer()
    text = "Größe ✓ 中文 😀 café naïve the end"  # mostly characters the tokenizer never merged
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push([i]) for i in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)  # no half characters ever shown
    assert sum(1 for p in pieces if p) < len(ids)  # some tokens were partial characters, held back


def test_ordered_stream_buffers_later_requests(capsys):
    import io

    tok = tiny_tokenizer()
    sink = io.StringIO()
    stream = OrderedStream(tok, ["a", "b"], {"a": "<a> ", "b": "<b> "}, sink)
    stream.update("b", tok.encode("second"), finished=True)
    assert sink.getvalue() == "<a> "  # b waits until a is done
    stream.update("a", tok.encode("first"), finished=False)
    assert sink.getvalue() == "<a> first"
    stream.update("a", [], finished=True)
    assert sink.getvalue() == "<a> first\n<b> second\n"


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--model", "/no/such/model"], "model path /no/such/model does not exist"),
        (["--set", "kv_cache.bogus=1"], "kv_cache.bogus: Extra inputs are not permitted"),
        (["--output", "/no/such/dir/out.jsonl"], "cannot write --output /no/such/dir/out.jsonl"),
        (["--policy", "fcfs+nonsense"], "unknown policy 'nonsense'"),
        ([], "give prompts as arguments or a JSONL file"),
        (["--input", "/no/such/prompts.jsonl"], "cannot read /no/such/prompts.jsonl"),
    ],
)
def test_bad_input_is_one_clear_line(cb_tiny_model_dir, capsys, argv, needle):
    base = ["generate"] if "--model" in argv else ["generate", "--model", str(cb_tiny_model_dir)]
    prompt = [] if not argv or "--input" in argv else ["hi"]
    code, out, err = run_cli(capsys, *base, *argv, *prompt)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("cb: error: ")
    assert needle in err


def test_debug_log_level_shows_the_traceback(capsys):
    with pytest.raises(Exception, match="does not exist"):
        main(["generate", "--model", "/no/such/model", "--log-level", "debug", "hi"])


def test_an_interrupt_keeps_every_finished_result(cb_tiny_model_dir, tmp_path):
    """Ctrl-C in the middle of a run: exit 130, and each result finished before it is in the file."""
    import os
    import signal
    import subprocess
    import sys
    import time

    # Two short requests, then six long ones: the interrupt lands while seconds of work remain.
    caps = [2, 22] + [400] * 6
    src = write_jsonl(
        tmp_path / "in.jsonl",
        *[{"prompt": f"request {i}", "max_new_tokens": cap, "id": f"r{i}"} for i, cap in enumerate(caps)],
    )
    out_file = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "cbcore.cli.main", "generate", "--model", str(cb_tiny_model_dir)]
    cmd += ["-i", str(src), "-o", str(out_file), "--no-progress", "--set", "scheduler.budget.max_num_seqs=1"]
    # A suite started in the background by a shell without job control inherits SIGINT ignored, and
    # Python then installs no KeyboardInterrupt handler: give the child the default disposition back.
    proc = subprocess.Popen(
        cmd,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if out_file.exists() and len(out_file.read_text().splitlines()) >= 2:
            break
        time.sleep(0.05)
    assert proc.poll() is None, f"the run ended before it could be interrupted: {proc.stderr.read()}"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    got = records(out_file.read_text())
    assert len(got) >= 2 and len(got) < len(caps)
    assert [r["id"] for r in got] == [f"r{i}" for i in range(len(got))]  # one at a time, in order
    assert all(r["output_tokens"] == caps[i] or r["finish_reason"] == "stop" for i, r in enumerate(got))


def test_an_unwritable_output_fails_before_the_model_loads(cb_tiny_model_dir, tmp_path, capsys):
    code, _, err = run_cli(
        capsys, "generate", "--model", str(cb_tiny_model_dir), "-o", str(tmp_path / "no" / "dir" / "out.jsonl"), "hi"
    )
    assert code != 0 and "cannot write --output" in err


def test_request_files_share_the_trace_record_and_read_its_old_id_spelling_with_a_note(tmp_path, capsys):
    from cbcore.cli.requests_util import read_jobs

    src = write_jsonl(
        tmp_path / "in.jsonl",
        {"prompt": "a", "id": "old-1"},
        {"prompt": "b", "id": "old-2"},
        {"prompt_token_ids": [5, 6], "request_id": "ids", "ignore_eos": True},
        {"prompt": "c", "arrival_s": 1.0},
    )
    jobs, bad = read_jobs(str(src), {"max_new_tokens": 4})
    assert [j.request_id for j in jobs] == ["old-1", "old-2", "ids"]
    assert jobs[2].params.ignore_eos and jobs[2].record.token_ids(None) == [5, 6]
    assert [str(b) for b in bad] == [
        f"{src}:4: arrival_s: every request of a request file starts at once (arrival times and follow-ups "
        "are for cb bench and cb simulate workloads)"
    ]
    err = capsys.readouterr().err
    assert err.count("'id' is read as 'request_id'") == 1  # one note per file
