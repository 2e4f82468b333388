"""Every write a plugin could make to what it is handed, tried: for tests of the views' promise.

A policy is handed views (``SeqView``, ``KVView``), frozen records
(``SchedulerState``, ``StepResult``) and copies (tuples, read-only mappings, a
frozen ``SamplingParams``); none of them may be changed through any public
name. :func:`try_writes` tries, on an object and on what its public
attributes hold (to ``depth`` levels): setting each attribute to a different
value, deleting it, and changing the containers in place (append, item
assignment, clear, pop). Each attempt is returned with what it raised; one
that raised nothing is a write that got through. Attributes starting with an
underscore are the engine's, outside the promise, and are not tried.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

#: (what was tried, the exception it raised: None if the write got through)
Attempt = tuple[str, BaseException | None]


def try_writes(obj: Any, path: str, depth: int = 2) -> list[Attempt]:
    """Try every write to ``obj`` (named ``path`` in the attempts) and, ``depth`` levels down, to what it holds."""
    attempts = _mutate(obj, path)
    if depth > 1 and isinstance(obj, tuple | list):
        for i, item in enumerate(obj):
            attempts += try_writes(item, f"{path}[{i}]", depth - 1)
    for name in public_names(obj):
        try:
            value = getattr(obj, name)
        except Exception:  # a property that cannot answer now (a view of something gone)
            continue
        where = f"{path}.{name}"
        attempts.append(_attempt(f"{where} = ...", lambda n=name, v=value: setattr(obj, n, _other(v))))
        attempts.append(_attempt(f"del {where}", lambda n=name: delattr(obj, n)))
        if depth > 1 and not callable(value):
            attempts += try_writes(value, where, depth - 1)
    return attempts


def public_names(obj: Any) -> list[str]:
    """The public names of what ``obj`` holds: a pydantic model's, a dataclass's or a named tuple's fields, else its properties,
    slots, instance attributes and methods (not a model's own API, nor anything of its class alone)."""
    cls = type(obj)
    if isinstance(getattr(cls, "model_fields", None), Mapping):
        return list(cls.model_fields)
    if dataclasses.is_dataclass(obj):
        return [f.name for f in dataclasses.fields(obj)]
    if isinstance(obj, tuple) and isinstance(getattr(cls, "_fields", None), tuple):  # a named tuple
        return list(cls._fields)
    held = (property, types.MemberDescriptorType, types.FunctionType)
    own = getattr(obj, "__dict__", {})
    return [n for n in dir(obj) if not n.startswith("_") and (n in own or isinstance(getattr(cls, n, None), held))]


def _mutate(value: Any, where: str) -> list[Attempt]:
    """In-place changes of a container (for the mappings and sequences a view hands out)."""
    tries: list[tuple[str, Callable[[], Any]]] = []
    if isinstance(value, Mapping):
        tries = [("[...] = 0", lambda: value.__setitem__("written", 0)), (".clear()", lambda: value.clear()),
                 (".pop()", lambda: value.popitem())]  # fmt: skip
    elif isinstance(value, Sequence) and not isinstance(value, str | bytes):
        tries = [(".append(0)", lambda: value.append(0)), ("[0] = 0", lambda: value.__setitem__(0, 0)),
                 (".clear()", lambda: value.clear()), (".pop()", lambda: value.pop())]  # fmt: skip
    return [_attempt(f"{where}{what}", call) for what, call in tries]


def _attempt(what: str, write: Callable[[], Any]) -> Attempt:
    try:
        write()
    except Exception as exc:
        return what, exc
    return what, None


def _other(value: Any) -> Any:
    """A value unlike ``value`` of its kind: a write of it would change what the engine reads."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value + 1
    if isinstance(value, str):
        return value + "-written"
    if isinstance(value, tuple):
        return (*value, 0)
    return 0 if value is None else None
