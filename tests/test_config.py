"""Config: dict, YAML and TOML sources, overrides, and errors that name the key."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from cbcore.config import ConfigError, EngineConfig


def test_empty_sections_mean_defaults():
    config = EngineConfig.model_validate({"scheduler": {}})
    assert config.scheduler.queue.name == "fcfs"
    assert config.kv_cache.block_size == 16


def test_yaml_and_toml_give_the_same_config(tmp_path):
    (tmp_path / "c.yaml").write_text(
        "scheduler:\n  queue: {name: priority, aging_s: 5.0}\n"
        "  budget: {name: token-budget, max_num_seqs: 8, max_num_batched_tokens: 512}\n"
        "backend: {name: eager}\nkv_cache: {block_size: 8, num_blocks: 64}\n"
    )
    (tmp_path / "c.toml").write_text(
        '[scheduler.queue]\nname = "priority"\naging_s = 5.0\n'
        '[scheduler.budget]\nname = "token-budget"\nmax_num_seqs = 8\nmax_num_batched_tokens = 512\n'
        '[backend]\nname = "eager"\n[kv_cache]\nblock_size = 8\nnum_blocks = 64\n'
    )
    a = EngineConfig.from_file(tmp_path / "c.yaml")
    b = EngineConfig.from_file(tmp_path / "c.toml")
    assert a == b
    assert a.scheduler.queue.params == {"aging_s": 5.0}


def test_overrides_reach_nested_keys_and_parse_values():
    config = EngineConfig.from_dict(
        {"scheduler": {"queue": "priority"}},
        ["scheduler.queue.aging_s=2.5", "kv_cache.num_blocks=32", "backend.name=eager"],
    )
    assert config.scheduler.queue.params == {"aging_s": 2.5}
    assert config.kv_cache.num_blocks == 32
    assert config.backend.name == "eager"


def test_unknown_override_key_is_named():
    with pytest.raises(ValidationError, match=r"kv_cache\.num_blockz"):
        EngineConfig.from_dict({}, ["kv_cache.num_blockz=3"])


def test_malformed_override():
    with pytest.raises(ConfigError, match=r"expected key\.path=value"):
        EngineConfig.from_dict({}, ["kv_cache.num_blocks"])


def test_policy_parameter_errors_name_the_slot():
    with pytest.raises(ValidationError, match=r"scheduler\.budget\.max_num_seqs"):
        EngineConfig.model_validate({"scheduler": {"budget": {"name": "token-budget", "max_num_seqs": 0}}})
    with pytest.raises(ValidationError, match=r"scheduler\.queue.*unknown queue plugin 'lifo'.*fcfs"):
        EngineConfig.model_validate({"scheduler": {"queue": "lifo"}})


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        EngineConfig.from_file(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("scheduler: [unclosed")
    with pytest.raises(ConfigError, match="not valid yaml"):
        EngineConfig.from_file(tmp_path / "bad.yaml")
    (tmp_path / "c.ini").write_text("")
    with pytest.raises(ConfigError, match="unknown suffix"):
        EngineConfig.from_file(tmp_path / "c.ini")
