"""The config files the docs' commands name (docs/configs) build the scheduler they describe.

A study's command is only reproducible if its configs load: a renamed policy or a
parameter the plugin no longer takes must fail here, not in a reader's run.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cbcore.cli.config_files import read_config_file
from cbcore.scheduling.policy_scheduler import build_scheduler
from cbcore.serve.config import Settings

CONFIGS = sorted((Path(__file__).parent.parent / "docs" / "configs").rglob("*.yaml"))


def test_the_docs_configs_are_found() -> None:
    names = {p.relative_to(p.parents[1]).as_posix() for p in CONFIGS}
    assert {"sjf/sjf-oracle.yaml", "traces/lpm.yaml", "traces/fcfs-no-prefix-cache.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.relative_to(p.parents[1]).as_posix())
def test_each_docs_config_builds_its_scheduler(path: Path) -> None:
    data = read_config_file(str(path))
    config = Settings.from_dict(data, [])
    scheduler, _ = build_scheduler(config, 64, lambda: 0.0)
    assert config.scheduler.queue.name == data["scheduler"]["queue"]["name"]
    params = {k: v for k, v in data["scheduler"]["queue"].items() if k != "name"}
    assert {k: config.scheduler.queue.params[k] for k in params} == params
    assert scheduler.blocks.view is not None
    assert config.kv_cache.prefix_caching is data.get("kv_cache", {}).get("prefix_caching", True)
