"""Config: dict, YAML and TOML sources, overrides, and errors that name the key."""

from __future__ import annotations

import argparse

import pytest
from pydantic import ValidationError

from cbcore.cli.common import engine_config
from cbcore.config import ConfigError, EngineConfig, format_validation_error
from cbcore.serve.config import ServeConfig, Settings
from cbcore.sim.profiler import QUICK, profile_config


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


# -- the applications' sections: one file, loaded whole by Settings ------------------------------

APP_FILE = (
    "scheduler:\n  queue: priority\nkv_cache: {num_blocks: 64}\n"
    "serve: {max_waiting: 8, watchdog_s: 5.0}\nrouter: {name: power-of-two, seed: 3}\n"
)
SETTINGS_HINT = "which the engine does not read; load the whole file with cbcore.serve.config.Settings"


def test_settings_load_the_whole_file_and_are_the_engine_config_of_its_engine_sections(tmp_path):
    path = tmp_path / "app.yaml"
    path.write_text(APP_FILE)
    settings = Settings.from_file(path)
    assert isinstance(settings, Settings) and isinstance(settings, EngineConfig)
    assert settings.serve.max_waiting == 8 and settings.serve.watchdog_s == 5.0
    assert settings.router.name == "power-of-two" and settings.router.params == {"seed": 3}
    engine_part = EngineConfig.model_validate(settings.model_dump(exclude={"serve", "router"}))
    assert engine_part.scheduler == settings.scheduler and engine_part.kv_cache == settings.kv_cache


@pytest.mark.parametrize(
    ("data", "overrides", "named"),
    [
        ({"serve": {"max_waiting": 8}}, [], ["serve: `cb serve`'s section"]),
        ({"router": "round-robin"}, [], ["router: the replicas' router"]),
        ({}, ["serve.max_waiting=8"], ["serve: `cb serve`'s section"]),
        ({"serve": {}, "router": "round-robin"}, [], ["router: the replicas' router", "serve: `cb serve`'s section"]),
    ],
)
def test_an_engine_config_names_an_application_section_and_the_model_that_reads_it(data, overrides, named):
    with pytest.raises(ValidationError) as info:
        EngineConfig.from_dict(data, overrides)
    message = format_validation_error(info.value)
    assert message.startswith(named[0]) and all(part in message for part in named), message
    assert message.endswith(f"{SETTINGS_HINT} (the cb commands do)"), message
    assert SETTINGS_HINT in str(info.value)  # also without format_validation_error


def test_an_engine_config_file_with_a_serve_section_is_refused_not_dropped(tmp_path):
    path = tmp_path / "app.yaml"
    path.write_text(APP_FILE)
    with pytest.raises(ValidationError, match=r"router: the replicas' router.*serve: `cb serve`'s section"):
        EngineConfig.from_file(path)


def test_serve_and_router_errors_name_their_key_with_a_suggestion():
    def problem(data: dict) -> str:
        with pytest.raises(ValidationError) as info:
            Settings.model_validate(data)
        return format_validation_error(info.value)

    assert problem({"serve": {"max_waitng": 3}}) == (
        "serve.max_waitng: Extra inputs are not permitted (did you mean 'max_waiting'?)"
    )
    assert problem({"servr": {}}).startswith("servr: Extra inputs are not permitted (did you mean 'serve'?)")
    assert problem({"router": "fcfs"}) == "router: 'fcfs' is a queue plugin, not a router plugin"
    with pytest.raises(ValidationError) as info:
        ServeConfig(max_waitng=3)
    assert format_validation_error(info.value).endswith("(did you mean 'max_waiting'?)")


def test_every_cb_command_loads_its_config_file_as_settings(tmp_path):
    """The commands build their config with ``engine_config``; `cb profile` then widens its budget."""
    path = tmp_path / "app.yaml"
    path.write_text(APP_FILE)
    args = argparse.Namespace(config=str(path), model=None, device=None, dtype=None, overrides=["serve.max_waiting=9"])
    config = engine_config(args)
    assert isinstance(config, Settings) and config.serve.max_waiting == 9 and config.router.name == "power-of-two"
    widened = profile_config(config, QUICK)
    assert isinstance(widened, Settings) and widened.serve == config.serve and widened.router == config.router
    assert widened.scheduler.budget.params["max_num_seqs"] == max(QUICK.widths) + 1
