"""Config values that could never work are refused with the config, before any model loads.

* ``inf`` and ``nan`` anywhere (the server's seconds, the KV budget, a plugin's
  parameters) pass a ``> 0`` check; they are refused by their key path.
* Time limits past a day and KV sizes past any device overflow a clock or an
  allocation after the model has loaded; they are refused by their bound.
* YAML aliases ("billion laughs": a few lines that name each other expand
  to billions of values) are refused, naming the file and the line.
* ``cb serve`` reports each of these before it looks for the model (the
  tests point it at a model directory that does not exist).
"""

from __future__ import annotations

import math
import time

import pytest
from pydantic import ValidationError

from cbcore.cli.main import main
from cbcore.config import ConfigError, EngineConfig, format_validation_error
from cbcore.serve.config import Settings


def problem(data: dict, overrides: list[str] | None = None) -> str:
    """The message for a config file's values (Settings: the engine's sections and the serve section)."""
    with pytest.raises(ValidationError) as info:
        Settings.from_dict(data, overrides)
    return format_validation_error(info.value)


@pytest.mark.parametrize(
    ("data", "where"),
    [
        ({"serve": {"shutdown_grace_s": math.inf}}, "serve.shutdown_grace_s: inf"),
        ({"serve": {"header_timeout_s": math.nan}}, "serve.header_timeout_s: nan"),
        ({"serve": {"watchdog_s": math.inf}}, "serve.watchdog_s: inf"),
        ({"kv_cache": {"max_memory_mb": math.inf}}, "kv_cache.max_memory_mb: inf"),
        ({"scheduler": {"queue": {"name": "priority", "aging_s": -math.inf}}}, "scheduler.queue.aging_s: -inf"),
    ],
)
def test_non_finite_numbers_are_refused_by_their_key(data, where):
    assert problem(data) == f"{where} is not a finite number"


def test_yaml_infinity_from_set_is_refused_and_a_string_is_not_a_number():
    assert problem({}, ["serve.body_timeout_s=.inf"]) == "serve.body_timeout_s: inf is not a finite number"
    # The serve section is strict like the rest: the string "inf" is not turned into a number.
    refused = problem({}, ["serve.shutdown_grace_s=inf"])
    assert refused.startswith("serve.shutdown_grace_s: Input should be a valid number")


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("serve.shutdown_grace_s", 1e300),
        ("serve.header_timeout_s", 86_401.0),
        ("serve.body_timeout_s", 1e10),
        ("serve.watchdog_s", 86_401.0),
        ("serve.retry_after_s", 10**20),
        ("serve.tokenizer_threads", 10**6),
        ("kv_cache.max_memory_mb", 1e300),
        ("kv_cache.num_blocks", 10**20),
        ("kv_cache.block_size", 10**9),
    ],
)
def test_values_past_their_bound_are_refused(key, value):
    section, field = key.split(".")
    assert problem({section: {field: value}}).startswith(f"{key}: Input should be less than or equal to")


def test_a_watchdog_of_no_time_is_refused():
    assert problem({"serve": {"watchdog_s": 0}}).startswith("serve.watchdog_s: Input should be greater than 0")


def test_values_at_their_bound_still_pass():
    config = Settings.from_dict({"serve": {"shutdown_grace_s": 86_400, "header_timeout_s": 0.5}})
    assert config.serve.shutdown_grace_s == 86_400.0 and config.serve.header_timeout_s == 0.5


LAUGHS = "".join(
    f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9) if i else ', '.join(['lol'] * 9)}]\n" for i in range(7)
)


def test_yaml_aliases_are_refused_naming_the_file_and_line(tmp_path):
    path = tmp_path / "laughs.yaml"
    path.write_text(LAUGHS)  # 9**7 = 4.8 million strings expanded (small: a regression fails, not swaps)
    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_file(path)
    assert time.perf_counter() - t0 < 5  # refused as read, not after an expansion (a generous bound)
    assert str(info.value).startswith(f"config file {path}: line 2: the alias *l0 is not accepted")
    with pytest.raises(ConfigError, match=r"--set 'serve.max_waiting=\[&a 1, \*a\]': line 1: the alias \*a"):
        Settings.from_dict({}, ["serve.max_waiting=[&a 1, *a]"])
    anchor_only = tmp_path / "anchor.yaml"
    anchor_only.write_text("serve: &s {max_waiting: 8}\n")  # an anchor nothing refers to expands nothing
    assert Settings.from_file(anchor_only).serve.max_waiting == 8


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--set", "serve.shutdown_grace_s=.inf"], "serve.shutdown_grace_s: inf is not a finite number"),
        (["--shutdown-grace", "inf"], "serve.shutdown_grace_s: inf is not a finite number"),
        (["--header-timeout", "nan"], "serve.header_timeout_s: nan is not a finite number"),
        (["--set", "kv_cache.max_memory_mb=1.0e+300"], "kv_cache.max_memory_mb: Input should be less than"),
    ],
)
def test_cb_serve_refuses_them_before_looking_for_the_model(flags, message, capsys, tmp_path):
    code = main(["serve", "--model", str(tmp_path / "no-such-model"), "--port", "0", *flags])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"cb: error: {message}"), err


def test_cb_serve_names_the_config_file_with_aliases(capsys, tmp_path):
    path = tmp_path / "laughs.yaml"
    path.write_text(LAUGHS)
    code = main(["serve", "--model", str(tmp_path / "no-such-model"), "--config", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"cb: error: config file {path}: line 2: the alias *l0"), err
