"""Helpers shared by subcommands: building the config and the engine from flags."""

from __future__ import annotations

import argparse
from typing import Any

from cbcore.config import EngineConfig, read_config_file


def config_data(args: argparse.Namespace) -> dict[str, Any]:
    """The config file (if any) with the model flags folded in, before ``--set``."""
    data: dict[str, Any] = read_config_file(args.config) if args.config else {}
    model = dict(data.get("model") or {})
    if args.model:
        model["path"] = args.model
    if args.device:
        model["device"] = args.device
    if args.dtype:
        model["dtype"] = args.dtype
    if model:
        data["model"] = model
    return data


def engine_config(args: argparse.Namespace, extra: dict[str, Any] | None = None) -> EngineConfig:
    """Config file, then ``extra`` (a subcommand's own flags), then ``--set`` overrides."""
    data = config_data(args)
    for key, value in (extra or {}).items():
        data[key] = {**(data.get(key) or {}), **value} if isinstance(value, dict) else value
    return EngineConfig.from_dict(data, args.overrides)


def load_engine(config: EngineConfig) -> Any:
    from cbcore.engine import Engine

    return Engine.from_pretrained(config.model.path, config=config)
