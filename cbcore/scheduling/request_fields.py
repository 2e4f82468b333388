"""Per-request fields beyond the prompt: identity, class and attributes that policies read.

Every field is checked strictly where a request enters (``Engine.add_request``,
trace and request-file parsing): a policy reads them on every step, so a
string where a number belongs, or an attribute that is not plain JSON, must
be refused at the door rather than surface as a wrong decision later.
``attrs`` is stored as a deep, read-only copy, so neither the caller nor a
policy can change what another policy sees.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

JSONValue = None | bool | int | float | str | list[Any] | dict[str, Any]

EMPTY_ATTRS: Mapping[str, Any] = MappingProxyType({})


class FieldError(ValueError):
    """A per-request field has the wrong type or value; the message names it."""


def check_request_id(value: object) -> str:
    if not isinstance(value, str) or not value:
        raise FieldError(f"request_id must be a non-empty str, got {value!r}")
    return value


def check_priority(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise FieldError(f"priority must be an int, got {type(value).__name__} {value!r}")
    return value


def check_client_id(value: object) -> str:
    if not isinstance(value, str) or not value:
        raise FieldError(f"client_id must be a non-empty str, got {value!r}")
    return value


def check_deadline(value: object) -> float | None:
    """Seconds after arrival by which the request should be done; None for no deadline."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise FieldError(f"deadline_s must be a number of seconds or None, got {type(value).__name__} {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise FieldError(f"deadline_s must be finite and > 0, got {value!r}")
    return float(value)


def freeze_attrs(attrs: Mapping[str, Any] | None) -> Mapping[str, Any]:
    """A read-only deep copy of ``attrs``; raises :class:`FieldError` on anything but JSON values.

    Objects become read-only mappings and arrays tuples, so a policy cannot
    change them; :func:`thaw` turns them back into plain JSON.
    """
    if attrs is None:
        return EMPTY_ATTRS
    if not isinstance(attrs, Mapping):
        raise FieldError(f"attrs must be a mapping of str to JSON values, got {type(attrs).__name__}")
    return _freeze(attrs, "attrs")


def _freeze(value: Any, where: str) -> Any:
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise FieldError(f"{where}: {value!r} is not a JSON number")
        return value
    if isinstance(value, Mapping):
        frozen = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise FieldError(f"{where}: key {key!r} is not a str")
            frozen[key] = _freeze(item, f"{where}.{key}")
        return MappingProxyType(frozen)
    if isinstance(value, list | tuple):
        return tuple(_freeze(item, f"{where}[{i}]") for i, item in enumerate(value))
    raise FieldError(f"{where}: {type(value).__name__} {value!r} is not a JSON value")


def thaw(value: Any) -> Any:
    """Plain JSON (dicts and lists) from a frozen attribute value."""
    if isinstance(value, Mapping):
        return {key: thaw(item) for key, item in value.items()}
    if isinstance(value, tuple | list):
        return [thaw(item) for item in value]
    return value
