"""Plugin discovery: pluggy hooks, entry points, and ``module:Class`` paths.

Built-in policies and backends register through the very entry points and
hooks an outside package uses (``cbcore.policies`` and ``cbcore.backends`` are
entry points of the ``cbcore`` distribution), so there is no privileged path:
what ``cb plugins`` lists is exactly what a config can name. It also keeps this
module at the bottom of the import graph: the registry never imports the
classes it checks, it recognises them by their bases.

Sources, in order: installed distributions exposing entry points in group
``cbcore`` (cbcore's own first), and the modules or ``.py`` files listed under
``plugins:`` in a config. A slot may also name a class directly as
``package.module:Class`` or ``path/to/file.py:Class``. An entry point that
fails to load is logged with its name and skipped: one broken package must
not take every other plugin down with it.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pluggy
from pydantic import BaseModel, ConfigDict, ValidationError

from cbcore.log import get_logger

log = get_logger(__name__)

PROJECT = "cbcore"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

#: kind -> the base class every plugin of that kind subclasses (by module and name: see the docstring).
BASES = {
    "queue": "cbcore.scheduling.policy.QueuePolicy",
    "budget": "cbcore.scheduling.policy.BudgetPolicy",
    "prefill": "cbcore.scheduling.policy.PrefillPolicy",
    "preemption": "cbcore.scheduling.policy.PreemptionPolicy",
    "scheduler": "cbcore.scheduling.scheduler.SchedulerPlugin",
    "router": "cbcore.scale.router.Router",
    "backend": "cbcore.execution.backend.Backend",
}
KINDS = tuple(BASES)
#: The scheduler's four policy slots (the first four kinds), in the order they are checked.
SLOTS = KINDS[:4]


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
        #: Entry points that failed to load or register: (name, why). Reported by `cb plugins`.
        self.broken: list[tuple[str, str]] = []
        self._modules: list[ModuleType] = []  # registered ones whose backend hooks are not called yet
        for ep in sorted(importlib.metadata.entry_points(group=PROJECT), key=lambda ep: _dist(ep) != PROJECT):
            origin = "built-in" if (dist := _dist(ep)) == PROJECT else f"entry point {dist}"
            try:
                self._add_module(ep.load(), origin)
            except Exception as exc:  # a broken third-party package names itself and is skipped
                self._skip(f"{ep.name} ({ep.value}, {origin})", exc)
        if not any(e.origin == "built-in" for e in self._entries.values()) and not self.broken:
            raise PluginError("cbcore's built-in plugins are not registered: reinstall cbcore (pip install -e .)")
        for ref in extra_plugins:
            self._add_module(load_module(ref), f"path {ref}")

    def _skip(self, what: str, exc: Exception) -> None:
        self.broken.append((what, why := f"{type(exc).__name__}: {exc}"))
        log.error("plugin entry point skipped", entry_point=what, error=why)

    def _add_module(self, module: ModuleType, origin: str, kinds: str = "policies") -> None:
        """Register ``module``'s hooks (once) and the plugins its ``cbcore_register_<kinds>`` hook returns.

        Backends are asked for at the first lookup of one (:meth:`_load_backends`):
        they import torch, which a process that runs no model (``cb simulate``)
        never needs (1.5 s of CPU and over 200 MB resident).
        """
        if not self.pm.is_registered(module):
            self.pm.register(module, name=f"{origin}:{module.__name__}")
            self._origins[id(module)] = origin
            self._modules.append(module)
        for impl in getattr(self.pm.hook, f"cbcore_register_{kinds}").get_hookimpls():
            if impl.plugin is module:
                for cls in impl.function() or []:
                    self._add_class(cls, self._origins[id(module)])

    def _load_backends(self) -> None:
        modules, self._modules = self._modules, []
        for module in modules:
            try:
                self._add_module(module, "", "backends")
            except Exception as exc:  # named and skipped, as an entry point that fails to load
                self._skip(f"{module.__name__} ({self._origins[id(module)]})", exc)

    def _add_class(self, cls: type, origin: str) -> None:
        kind, name = _identity(cls, origin)
        first = self._entries.setdefault((kind, name), Registered(cls, kind, name, origin))
        if not _same_class(first.cls, cls):
            raise PluginError(
                f"two plugins claim {kind} {name!r}: {first.cls.__module__}.{first.cls.__qualname__} "
                f"({first.origin}) and {cls.__module__}.{cls.__qualname__} ({origin})"
            )

    # -- lookup --------------------------------------------------------------

    def entries(self, kind: str | None = None) -> list[Registered]:
        if kind in (None, "backend"):
            self._load_backends()
        return [e for e in self._entries.values() if kind is None or e.kind == kind]

    def names(self, kind: str) -> list[str]:
        return sorted(e.name for e in self.entries(kind))

    def get(self, kind: str, name: str) -> Registered:
        if ":" in name:
            cls = load_class(name)
            if (found_kind := _identity(cls, f"path {name}")[0]) != kind:
                raise PluginError(f"{name} is a {found_kind} plugin, not a {kind} plugin")
            return Registered(cls, kind, getattr(cls, "name", name), f"path {name}")
        if kind == "backend":
            self._load_backends()
        if (kind, name) in self._entries:
            return self._entries[kind, name]
        if others := [e for e in self._entries.values() if e.name == name]:
            raise PluginError(f"{name!r} is a {others[0].kind} plugin, not a {kind} plugin")
        hint = did_you_mean(name, self.names(kind))
        raise PluginError(f"unknown {kind} plugin {name!r}{hint}; known: {', '.join(self.names(kind)) or 'none'}")

    def params_for(self, kind: str, name: str, params: dict[str, Any], where: str) -> BaseModel:
        """The plugin's own ``Params`` model validated from ``params``; errors name ``where.key``."""
        try:
            model = self.get(kind, name).cls.Params
        except PluginError as exc:
            raise PluginError(f"{where}: {exc}") from None
        try:
            return model.model_validate(params, strict=True)
        except ValidationError as exc:
            raise PluginError("; ".join(validation_problems(exc, model, where))) from None

    def create(self, kind: str, name: str, params: dict[str, Any], where: str, *args: Any) -> Any:
        return self.get(kind, name).cls(self.params_for(kind, name, params, where), *args)


def _dist(ep: importlib.metadata.EntryPoint) -> str:
    return ep.dist.name if ep.dist is not None else ep.value


def _same_class(a: type, b: type) -> bool:
    """One class, possibly imported twice (as an installed module and as a ``plugins:`` file)."""
    if a is b:
        return True
    try:
        same_file = Path(inspect.getfile(a)).resolve() == Path(inspect.getfile(b)).resolve()
    except (TypeError, OSError):
        return False
    return same_file and a.__qualname__ == b.__qualname__


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
    base = BASES[kind]
    where = f"{cls.__module__}.{cls.__qualname__} ({origin})"
    if base not in {f"{c.__module__}.{c.__qualname__}" for c in cls.__mro__}:
        raise PluginError(
            f"{where} declares kind {kind!r} but does not subclass cbcore.{base.rpartition('.')[2]}"
        )
    params = getattr(cls, "Params", None)
    if not (isinstance(params, type) and issubclass(params, BaseModel)):
        raise PluginError(f"{where}: `Params` must be a pydantic BaseModel class")
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
        module = sys.modules[mod_name] = importlib.util.module_from_spec(spec)
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


# -- "did you mean ...?" for unknown names: plugin names, config keys, request fields --------


def did_you_mean(name: object, known: Iterable[str]) -> str:
    """`` (did you mean 'priority'?)`` when a known name is close to ``name``, else ``""``."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6) if isinstance(name, str) else []
    return f" (did you mean {close[0]!r}?)" if close else ""


def fields_at(model: type[BaseModel] | None, path: Iterable[Any]) -> list[str]:
    """The field names of the (sub)model at ``path`` inside ``model``; [] where it cannot tell."""
    for part in path:
        if model is None:
            return []
        annotation = getattr(model.model_fields.get(str(part)), "annotation", None)
        model = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    return list(model.model_fields) if model is not None else []


def validation_problems(exc: ValidationError, model: type[BaseModel] | None = None, prefix: str = "") -> list[str]:
    """``key.path: message`` per problem; an unknown key gets the closest known one suggested."""
    problems = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden" and loc:
            msg += did_you_mean(loc[-1], fields_at(model, loc[:-1]))
        where = ".".join(p for p in (prefix, *loc) if p)
        problems.append(msg if msg.startswith(where) else f"{where}: {msg}")  # a message that names its key
    return problems
