""""Did you mean ...?" for unknown names: plugin names, config keys, request fields."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ValidationError


def did_you_mean(name: object, known: Iterable[str]) -> str:
    """`` (did you mean 'priority'?)`` when a known name is close to ``name``, else ``""``."""
    if not isinstance(name, str):
        return ""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def fields_at(model: type[BaseModel] | None, path: Iterable[Any]) -> list[str]:
    """The field names of the (sub)model at ``path`` inside ``model``; [] where it cannot tell."""
    for part in path:
        if model is None:
            return []
        field = model.model_fields.get(str(part))
        annotation = getattr(field, "annotation", None)
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
        problems.append(f"{where}: {msg}" if where else msg)
    return problems
