"""Config files and ``--set`` overrides: YAML, TOML or JSON text into the plain data a config model validates.

The ``cb`` commands read their ``--config`` file and ``--set key.path=value``
flags here, and so do :meth:`cbcore.config.EngineConfig.from_file` and
``from_dict``. What comes out is plain data, not yet validated: file paths in
it (``plugins:`` entries, ``path/to/file.py:Class`` names in a plugin section)
are made relative to the file, as includes are. YAML aliases are refused
(:class:`YamlAliasError`): a few nested ones expand without bound. Once a
model refuses the data, :func:`format_validation_error` says what is wrong on
one line, suggesting the closest known key for an unknown one.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from cbcore.plugins import SLOTS, validation_problems


class ConfigError(ValueError):
    """A configuration problem, with a message that names the offending key or file."""


class YamlAliasError(ValueError):
    """A YAML text used an alias (the message names its line)."""


class _NoAliasLoader(yaml.SafeLoader):
    """YAML without aliases: a few nested ``*alias`` lines name each other into billions of values
    ("billion laughs"), which grow without bound once copied or validated. A config never needs them."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise YamlAliasError(
                f"line {event.start_mark.line + 1}: the alias *{event.anchor} is not accepted "
                "(YAML aliases can expand without bound); write the value out"
            )
        return super().compose_node(parent, index)


def load_yaml(text: str) -> Any:
    """``yaml.safe_load`` without aliases (:class:`YamlAliasError` names the line of the first)."""
    return yaml.load(text, Loader=_NoAliasLoader)  # a SafeLoader subclass


_PARSERS = {".toml": tomllib.loads, ".json": json.loads, ".yaml": load_yaml, ".yml": load_yaml}


def read_config_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    if (parse := _PARSERS.get(path.suffix)) is None:
        raise ConfigError(f"config file {path}: unknown suffix {path.suffix!r} (use .yaml, .toml or .json)")
    try:
        data = parse(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"config file {path} is not valid {path.suffix[1:]}: {exc}") from None
    except YamlAliasError as exc:
        raise ConfigError(f"config file {path}: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    # File paths are relative to the config file, like includes...
    if isinstance(plugins := data.get("plugins"), list):
        data["plugins"] = [_relative_to(path.parent, p) for p in plugins]
    for section in _slots(data):  # ...and so are `path/to/file.py:Class` names in a slot
        if isinstance(name := section.get("name"), str) and ".py:" in name:
            file, _, cls = name.rpartition(":")
            section["name"] = f"{_relative_to(path.parent, file)}:{cls}"
    return data


def _slots(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The plugin sections of a config: the four policy slots, a whole scheduler, backend, router."""
    places = [(data, "backend"), (data, "router")]
    if isinstance(sched := data.get("scheduler"), dict):
        places += [(sched, slot) for slot in SLOTS]
    for parent, key in places:
        if isinstance(parent.get(key), str):  # the `queue: fcfs` shorthand
            parent[key] = {"name": parent[key]}
    return [s for s in [*(parent.get(key) for parent, key in places), sched] if isinstance(s, dict)]


def _relative_to(base: Path, ref: Any) -> Any:
    is_path = isinstance(ref, str) and (ref.endswith(".py") or "/" in ref)
    return str(base / ref) if is_path and not Path(ref).expanduser().is_absolute() else ref


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``key.path=value`` strings; values are parsed as YAML scalars (``4``, ``true``, ``null``)."""
    data = json.loads(json.dumps(data))  # deep copy of plain data
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected key.path=value")
        parts = key.strip().split(".")
        node = data
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if isinstance(child, str):  # `queue: fcfs` shorthand becomes a mapping
                child = node[part] = {"name": child}
            if not isinstance(child, dict):
                raise ConfigError(f"--set {item!r}: {part!r} is not a section")
            node = child
        try:
            node[parts[-1]] = load_yaml(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"--set {item!r}: the value is not valid YAML: {exc}") from None
        except YamlAliasError as exc:
            raise ConfigError(f"--set {item!r}: {exc}") from None
    return data


def format_validation_error(exc: ValidationError) -> str:
    """One line per problem: ``key.path: message``; an unknown key gets the closest known one suggested
    (from the fields of the model that failed, when it is registered with :func:`suggests_keys`)."""
    return "; ".join(validation_problems(exc, _MODELS.get(exc.title)))


_MODELS: dict[str, type[BaseModel]] = {}
_Model = TypeVar("_Model", bound=type[BaseModel])


def suggests_keys(model: _Model) -> _Model:
    """Class decorator: :func:`format_validation_error` suggests this config model's keys (found by its
    name, which a ValidationError carries)."""
    _MODELS[model.__name__] = model
    return model
