"""Plugin discovery: pluggy hooks, entry points, and ``module:Class`` paths.

Built-in policies and backends register through the very hooks an outside
package implements, so there is no privileged path: what ``cb plugins`` lists
is exactly what a config can name.

Sources, in order: the built-ins (``cbcore.policies``, ``cbcore.backends``),
installed distributions exposing entry points in group ``cbcore``, and the
modules or ``.py`` files listed under ``plugins:`` in a config. A slot may also
name a class directly as ``package.module:Class`` or ``path/to/file.py:Class``.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pluggy
from pydantic import BaseModel, ConfigDict, ValidationError

from cbcore.suggest import did_you_mean, validation_problems

PROJECT = "cbcore"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

KINDS = ("queue", "budget", "prefill", "preemption", "scheduler", "router", "backend")


class NoParams(BaseModel):
    """The parameters of a plugin that takes none (any key given is an error)."""

    model_config = ConfigDict(extra="forbid")


class PluginError(ValueError):
    """A plugin could not be found, loaded or configured; the message says which and why."""


class HookSpecs:
    @hookspec
    def cbcore_register_policies(self) -> list[type]:
        """Return policy classes (queue, budget, prefill, preemption, whole-scheduler or router kinds)."""

    @hookspec
    def cbcore_register_backends(self) -> list[type]:
        """Return attention backend classes."""


@dataclass(frozen=True)
class Registered:
    cls: type
    kind: str
    name: str
    origin: str  # "built-in", "entry point <dist>", "path <module or file>"


class Registry:
    """Every policy and backend known to this process, keyed by (kind, name)."""

    def __init__(self, extra_plugins: tuple[str, ...] = ()) -> None:
        self.pm = pluggy.PluginManager(PROJECT)
        self.pm.add_hookspecs(HookSpecs)
        self._origins: dict[int, str] = {}
        self._entries: dict[tuple[str, str], Registered] = {}

        import cbcore.backends
        import cbcore.policies

        self._add_plugin(cbcore.policies, "built-in")
        self._add_plugin(cbcore.backends, "built-in")
        for ep in importlib.metadata.entry_points(group=PROJECT):
            try:
                module = ep.load()
            except Exception as exc:  # a broken third-party package must name itself
                raise PluginError(f"entry point {ep.name!r} ({ep.value}) failed to load: {exc}") from exc
            dist = ep.dist.name if ep.dist is not None else ep.value
            self._add_plugin(module, f"entry point {dist}")
        for ref in extra_plugins:
            self._add_plugin(load_module(ref), f"path {ref}")
        self._collect()

    def _add_plugin(self, module: ModuleType, origin: str) -> None:
        if self.pm.is_registered(module):
            return
        self.pm.register(module, name=f"{origin}:{module.__name__}")
        self._origins[id(module)] = origin

    def _collect(self) -> None:
        for hook in (self.pm.hook.cbcore_register_policies, self.pm.hook.cbcore_register_backends):
            for impl in hook.get_hookimpls():  # registration order (pluggy calls them in reverse)
                origin = self._origins[id(impl.plugin)]
                for cls in impl.function() or []:
                    self._add_class(cls, origin)

    def _add_class(self, cls: type, origin: str) -> None:
        kind, name = _identity(cls, origin)
        key = (kind, name)
        if key in self._entries and not _same_class(self._entries[key].cls, cls):
            first = self._entries[key]
            raise PluginError(
                f"two plugins claim {kind} {name!r}: {first.cls.__module__}.{first.cls.__qualname__} "
                f"({first.origin}) and {cls.__module__}.{cls.__qualname__} ({origin})"
            )
        self._entries.setdefault(key, Registered(cls, kind, name, origin))

    # -- lookup --------------------------------------------------------------

    def entries(self, kind: str | None = None) -> list[Registered]:
        return [e for e in self._entries.values() if kind is None or e.kind == kind]

    def names(self, kind: str) -> list[str]:
        return sorted(e.name for e in self.entries(kind))

    def get(self, kind: str, name: str) -> Registered:
        if ":" in name:
            cls = load_class(name)
            found_kind, _ = _identity(cls, f"path {name}")
            if found_kind != kind:
                raise PluginError(f"{name} is a {found_kind} plugin, not a {kind} plugin")
            return Registered(cls, kind, getattr(cls, "name", name), f"path {name}")
        entry = self._entries.get((kind, name))
        if entry is not None:
            return entry
        others = [e for e in self._entries.values() if e.name == name]
        if others:
            raise PluginError(f"{name!r} is a {others[0].kind} plugin, not a {kind} plugin")
        hint = did_you_mean(name, self.names(kind))
        raise PluginError(f"unknown {kind} plugin {name!r}{hint}; known: {', '.join(self.names(kind)) or 'none'}")

    def params_for(self, kind: str, name: str, params: dict[str, Any], where: str) -> BaseModel:
        entry = self.get(kind, name)
        model = getattr(entry.cls, "Params", None)
        if model is None:
            raise PluginError(f"{where}: plugin {name!r} has no Params model")
        try:
            return model.model_validate(params, strict=True)
        except ValidationError as exc:
            raise PluginError("; ".join(validation_problems(exc, model, where))) from None

    def validate(self, kind: str, name: str, params: dict[str, Any], where: str) -> None:
        try:
            self.params_for(kind, name, params, where)
        except PluginError as exc:
            msg = str(exc)
            raise PluginError(msg if msg.startswith(where) else f"{where}: {msg}") from None

    def create(self, kind: str, name: str, params: dict[str, Any], where: str, *args: Any) -> Any:
        entry = self.get(kind, name)
        return entry.cls(self.params_for(kind, name, params, where), *args)


def _same_class(a: type, b: type) -> bool:
    """One class, possibly imported twice (as an installed module and as a ``plugins:`` file)."""
    if a is b:
        return True
    try:
        same_file = Path(inspect.getfile(a)).resolve() == Path(inspect.getfile(b)).resolve()
    except (TypeError, OSError):
        return False
    return same_file and a.__qualname__ == b.__qualname__


def _base_classes() -> dict[str, type]:
    from cbcore.execution.backend import Backend
    from cbcore.scheduling.policy import POLICY_KINDS
    from cbcore.scheduling.router import Router
    from cbcore.scheduling.scheduler import SchedulerPlugin

    return {**POLICY_KINDS, "scheduler": SchedulerPlugin, "router": Router, "backend": Backend}


def _identity(cls: type, origin: str) -> tuple[str, str]:
    """Check that ``cls`` is a well-formed plugin class; return its (kind, name).

    Checked at registration so that a malformed third-party class fails with
    its own name and origin, not later inside the engine.
    """
    kind = getattr(cls, "kind", None)
    name = getattr(cls, "name", None)
    if not isinstance(cls, type) or kind not in KINDS or not isinstance(name, str) or not name:
        raise PluginError(
            f"{cls!r} from {origin} is not a cbcore plugin: it needs a `name` and a `kind` in {KINDS}"
        )
    base = _base_classes()[kind]
    if not issubclass(cls, base):
        raise PluginError(
            f"{cls.__module__}.{cls.__qualname__} ({origin}) declares kind {kind!r} "
            f"but does not subclass cbcore.{base.__qualname__}"
        )
    params = getattr(cls, "Params", None)
    if not (isinstance(params, type) and issubclass(params, BaseModel)):
        raise PluginError(
            f"{cls.__module__}.{cls.__qualname__} ({origin}): `Params` must be a pydantic BaseModel class"
        )
    return kind, name


def load_module(ref: str) -> ModuleType:
    """Import ``package.module`` or a ``.py`` file path."""
    if ref.endswith(".py") or "/" in ref or "\\" in ref:
        path = Path(ref).expanduser().resolve()
        if not path.is_file():
            raise PluginError(f"plugin file {ref} does not exist")
        mod_name = f"cbcore_plugin_{path.stem}_{abs(hash(str(path))):x}"
        if mod_name in sys.modules:
            return sys.modules[mod_name]
        spec = importlib.util.spec_from_file_location(mod_name, path)
        if spec is None or spec.loader is None:
            raise PluginError(f"cannot import plugin file {ref}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            del sys.modules[mod_name]
            raise PluginError(f"plugin file {ref} failed to import: {exc}") from exc
        return module
    try:
        return importlib.import_module(ref)
    except ImportError as exc:
        raise PluginError(f"cannot import plugin module {ref!r}: {exc}") from exc


def load_class(ref: str) -> type:
    """Resolve ``package.module:Class`` or ``path/to/file.py:Class``."""
    module_ref, _, attr = ref.rpartition(":")
    if not module_ref or not attr:
        raise PluginError(f"{ref!r}: expected module:Class or path/to/file.py:Class")
    module = load_module(module_ref)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise PluginError(f"{module_ref} has no attribute {attr!r}") from None


@functools.lru_cache(maxsize=16)
def get_registry(extra_plugins: tuple[str, ...] = ()) -> Registry:
    """The process-wide registry (cached per list of extra plugin modules)."""
    return Registry(extra_plugins)
