"""Helpers shared by subcommands: building the config and the engine from flags."""

from __future__ import annotations

import argparse
import json
from typing import Any

from cbcore.cli.config_files import read_config_file
from cbcore.config import EngineConfig
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


def engine_config(args: argparse.Namespace, extra: dict[str, Any] | None = None, backend: bool = True) -> Settings:
    """Config file, then ``extra`` (a subcommand's own flags), then ``--set`` overrides: the whole file,
    the ``serve:`` and ``router:`` sections included, whichever command reads them. ``backend=False``
    (a simulated engine) leaves the backend section unchecked: checking it would load torch."""
    data = config_data(args)
    for key, value in (extra or {}).items():
        data[key] = {**(data.get(key) or {}), **value} if isinstance(value, dict) else value
    return Settings.from_dict(data, args.overrides, backend)


def load_engine(config: EngineConfig) -> Any:
    from cbcore.engine import Engine

    return Engine.from_pretrained(config.model.path, config=config)


#: The scheduler's phase orders (``scheduler.order``), accepted as items of `--policy a+b+c`.
PHASE_ORDERS = ("decode-first", "prefill-first")
# Short names accepted in `--policy a+b+c` for the built-in policies.
POLICY_ALIASES = {
    "chunked": "chunked-prefill",
    "whole": "whole-prompt",
    "budget": "token-budget",
}


def split_top(text: str, sep: str) -> list[str]:
    """``text`` split at ``sep`` outside brackets and quotes (``a(x=1,y=[2,3])+b`` at ``+``)."""
    parts, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(text):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def policy_params(mix: str, item: str) -> tuple[str, dict[str, Any]]:
    """``sjf(aging_s=0.5,weights={"a":2})`` -> ("sjf", {"aging_s": 0.5, "weights": {"a": 2}}).

    A value is read as JSON when it parses as JSON (numbers, true/false/null,
    lists, objects), else as text (``victim=least-progress``).
    """
    from cbcore.plugins import PluginError

    name, paren, rest = item.partition("(")
    if not paren:
        return item, {}
    if not rest.endswith(")"):
        raise PluginError(f"--policy {mix!r}: {item!r}: expected NAME(KEY=VALUE,...)")
    params: dict[str, Any] = {}
    for pair in filter(None, (p.strip() for p in split_top(rest[:-1], ","))):
        key, eq, value = pair.partition("=")
        if not eq or not key.strip():
            raise PluginError(f"--policy {mix!r}: {name.strip()}: expected KEY=VALUE, got {pair!r}")
        try:
            params[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            params[key.strip()] = value.strip()
    return name.strip(), params


def scheduler_from_mix(mix: str, plugins: tuple[str, ...] = ()) -> dict[str, Any]:
    """``"priority+chunked+swap"`` -> a ``scheduler`` section with one policy per named slot.

    Each ``+``-separated name (or alias) is looked up in the registry, which
    says its kind; slots not named keep their defaults. Two names of one kind
    are an error. A name may carry its parameters, ``sjf(aging_s=0.5)``
    (:func:`policy_params`), for this row alone; ``decode-first`` or
    ``prefill-first`` sets the row's ``scheduler.order``.
    """
    from cbcore.plugins import KINDS, PluginError, did_you_mean, get_registry

    registry = get_registry(plugins)
    section: dict[str, Any] = {}
    for item in split_top(mix, "+"):
        raw, params = policy_params(mix, item.strip())
        if raw in PHASE_ORDERS and not params:  # the scheduler's phase order, named in the mix
            if "order" in section:
                raise PluginError(f"--policy {mix!r}: two phase orders ({section['order']!r} and {raw!r})")
            section["order"] = raw
            continue
        name = POLICY_ALIASES.get(raw.strip(), raw.strip())
        if not name:
            raise PluginError(f"--policy {mix!r}: empty policy name")
        policies = [e for kind in KINDS if kind != "backend" for e in registry.entries(kind)]  # backends load torch
        kinds = [e.kind for e in policies if e.name == name]
        if not kinds:
            known = sorted({e.name for e in policies} | set(POLICY_ALIASES))
            hint = did_you_mean(name, known)
            raise PluginError(f"--policy {mix!r}: unknown policy {name!r}{hint}; known: {', '.join(known)}")
        kind = kinds[0]
        if kind == "scheduler":
            if len(split_top(mix, "+")) > 1:
                raise PluginError(f"--policy {mix!r}: {name!r} replaces the whole scheduler; name it alone")
            return {"name": name, **params}
        if kind in section:
            raise PluginError(
                f"--policy {mix!r}: both {section[kind]['name']!r} and {name!r} are {kind} policies"
            )
        section[kind] = {"name": name, **params}
    return section
