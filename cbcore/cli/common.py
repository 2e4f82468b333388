"""Helpers shared by subcommands: building the config and the engine from flags."""

from __future__ import annotations

import argparse
from typing import Any

from cbcore.config import EngineConfig, read_config_file
from cbcore.serve.config import Settings


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


def engine_config(args: argparse.Namespace, extra: dict[str, Any] | None = None) -> Settings:
    """Config file, then ``extra`` (a subcommand's own flags), then ``--set`` overrides: the whole file,
    the ``serve:`` and ``router:`` sections included, whichever command reads them."""
    data = config_data(args)
    for key, value in (extra or {}).items():
        data[key] = {**(data.get(key) or {}), **value} if isinstance(value, dict) else value
    return Settings.from_dict(data, args.overrides)


def load_engine(config: EngineConfig) -> Any:
    from cbcore.engine import Engine

    return Engine.from_pretrained(config.model.path, config=config)


# Short names accepted in `--policy a+b+c` for the built-in policies.
POLICY_ALIASES = {
    "chunked": "chunked-prefill",
    "whole": "whole-prompt",
    "budget": "token-budget",
}


def scheduler_from_mix(mix: str, plugins: tuple[str, ...] = ()) -> dict[str, Any]:
    """``"priority+chunked+swap"`` -> a ``scheduler`` section with one policy per named slot.

    Each ``+``-separated name (or alias) is looked up in the registry, which
    says its kind; slots not named keep their defaults. Two names of one kind
    are an error.
    """
    from cbcore.plugins import PluginError, did_you_mean, get_registry

    registry = get_registry(plugins)
    section: dict[str, Any] = {}
    for raw in mix.split("+"):
        name = POLICY_ALIASES.get(raw.strip(), raw.strip())
        if not name:
            raise PluginError(f"--policy {mix!r}: empty policy name")
        kinds = [e.kind for e in registry.entries() if e.name == name and e.kind != "backend"]
        if not kinds:
            known = sorted({e.name for e in registry.entries() if e.kind != "backend"} | set(POLICY_ALIASES))
            hint = did_you_mean(name, known)
            raise PluginError(f"--policy {mix!r}: unknown policy {name!r}{hint}; known: {', '.join(known)}")
        kind = kinds[0]
        if kind == "scheduler":
            if section:
                raise PluginError(f"--policy {mix!r}: {name!r} replaces the whole scheduler; name it alone")
            return {"name": name}
        if kind in section:
            raise PluginError(
                f"--policy {mix!r}: both {section[kind]['name']!r} and {name!r} are {kind} policies"
            )
        section[kind] = {"name": name}
    return section
