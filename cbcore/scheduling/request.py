"""A request at the door: the fields policies read, and what must hold before it is queued.

:class:`RequestFields` is the one model of the per-request scheduling fields;
the engine, the server's wire models, request files and workload traces all
validate through it (they subclass it), so a field means the same everywhere
and is refused the same way. It is strict: a policy reads these fields every
step, so a string where a number belongs, or an attribute that is not plain
JSON, must be refused here rather than surface as a wrong decision later.
``attrs`` is stored as a deep, read-only copy, so neither the caller nor a
policy can change what another policy sees.

:func:`check_request` refuses what could never run to completion (empty or
unknown tokens, no room in the model's context or in the whole KV cache), and
:func:`max_new_tokens_limit` is the one place that says how many tokens a
prompt may still generate: the server's ``max_tokens`` check uses it too.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Mapping
from types import MappingProxyType
from typing import Annotated, Any

import numpy as np
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from cbcore.plugins import validation_problems
from cbcore.scheduling.sampling_params import SamplingParams

Prompt = str | list[int] | array  # an array('i') of ids is kept as the sequence's token array (4 bytes an id)
EMPTY_ATTRS: Mapping[str, Any] = MappingProxyType({})


class RequestError(ValueError):
    """A request was refused before it ran; the message says what was wrong with it."""


def _priority(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"priority must be an int, got {type(value).__name__} {value!r}")
    return value


def nonempty_str(value: object, name: str = "request_id") -> str:
    """``value`` if it is a non-empty str, else a :class:`RequestError` naming ``name``."""
    if not isinstance(value, str) or not value:
        raise RequestError(f"{name} must be a non-empty str, got {value!r}")
    return value


def _deadline(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"deadline_s must be a number of seconds or None, got {type(value).__name__} {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"deadline_s must be finite and > 0, got {value!r}")
    return float(value)


def freeze_attrs(attrs: Mapping[str, Any] | None, max_depth: int = 64) -> Mapping[str, Any]:
    """A read-only deep copy of ``attrs``; raises ValueError on anything but JSON values.

    Objects become read-only mappings and arrays tuples, so a policy cannot
    change them; ``cbcore.bench.workload.thaw`` turns them back into plain JSON.
    Nesting deeper than ``max_depth`` levels (``attrs`` itself is the first)
    is refused by the path where it passes the limit: a client's body must not
    be able to exhaust the stack of whatever walks it later.
    """
    if attrs is None:
        return EMPTY_ATTRS
    if not isinstance(attrs, Mapping):
        raise ValueError(f"attrs must be a mapping of str to JSON values, got {type(attrs).__name__}")
    return _freeze(attrs, "attrs", max_depth)


def _freeze(value: Any, where: str, max_depth: int, depth: int = 1) -> Any:
    """``value`` as a read-only copy (an object as a read-only mapping in its key order, an array as a
    tuple), refused by ``where`` when it is not JSON. The depth is checked before each level is entered,
    so the recursion stays within ``max_depth`` frames, a cycle included."""
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where}: {value!r} is not a JSON number")
        return value
    if not isinstance(value, Mapping | list | tuple):
        raise ValueError(f"{where}: {type(value).__name__} {value!r} is not a JSON value")
    if depth > max_depth:
        shown = where if len(where) <= 200 else where[:200] + "..."
        raise ValueError(f"{shown}: nested deeper than {max_depth} levels")
    if isinstance(value, Mapping):
        if bad := [key for key in value if not isinstance(key, str)]:
            raise ValueError(f"{where}: key {bad[0]!r} is not a str")
        items = {key: _freeze(item, f"{where}.{key}", max_depth, depth + 1) for key, item in value.items()}
        return MappingProxyType(items)
    return tuple(_freeze(item, f"{where}[{i}]", max_depth, depth + 1) for i, item in enumerate(value))


#: Each field's type and check, for any model that carries it (the server's wire models name the client ``user``).
Priority = Annotated[int, BeforeValidator(_priority)]
ClientId = Annotated[str, BeforeValidator(lambda value: nonempty_str(value, "client_id"))]
DeadlineS = Annotated[float | None, BeforeValidator(_deadline)]
Attrs = Annotated[Any, BeforeValidator(freeze_attrs)]


class RequestFields(BaseModel):
    """What policies read to tell requests apart (docs/policies.md); request files and traces subclass it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    priority: Priority = 0  # smaller is served first by 'priority'
    client_id: ClientId = "default"  # the tenant, for fair share
    deadline_s: DeadlineS = None  # seconds after arrival by which it should be done (met: e2e <= deadline_s)
    attrs: Attrs = Field(default_factory=lambda: EMPTY_ATTRS)  # free-form JSON policies may read (read-only)


def _params(value: object) -> SamplingParams:
    if not isinstance(value, SamplingParams):
        raise ValueError(f"params must be SamplingParams, got {type(value).__name__}")
    return value


def _arrival(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"arrival_time must be a number (finite seconds), got {value!r}")
    return float(value)


def _salt(value: object) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ValueError(f"cache_salt must be a string, got {type(value).__name__}")
    return value


class Request(RequestFields):
    """Everything a request brings to the engine's door besides its prompt, checked strictly in one place."""

    request_id: Annotated[str, BeforeValidator(nonempty_str)]
    params: Annotated[SamplingParams, BeforeValidator(_params)]
    arrival_time: Annotated[float | None, BeforeValidator(_arrival)] = None  # scheduler clock; None: now
    cache_salt: Annotated[str | None, BeforeValidator(_salt)] = None  # only requests with one salt share cached KV

    @classmethod
    def checked(cls, **fields: Any) -> Request:
        """The request, or a :class:`RequestError` naming every field that is wrong (and the request)."""
        try:
            return cls(**fields)
        except (ValidationError, RequestError) as exc:
            rid = fields.get("request_id")
            where = f"request {rid!r}: " if isinstance(rid, str) and rid else ""
            raise RequestError(where + (field_problems(exc) if isinstance(exc, ValidationError) else str(exc))) from None


def field_problems(exc: ValidationError) -> str:
    """A :class:`RequestFields` error on one line: the field's own message (which names it), else ``field: why``."""
    return "; ".join(validation_problems(exc))


def encode_prompt(prompt: Prompt, request_id: str, tokenizer: Any | None) -> list[int] | array:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise RequestError(f"request {request_id}: a text prompt needs a tokenizer; pass token ids")
        return list(tokenizer.encode(prompt))
    if isinstance(prompt, array) and prompt.typecode == "i":
        return prompt[:]  # the engine's own copy: it appends the output to it
    if not isinstance(prompt, list | tuple) or not all(type(t) is int for t in prompt):
        raise RequestError(f"request {request_id}: a prompt is a string, a list of int token ids or an array('i')")
    return list(prompt)


def max_new_tokens_limit(prompt_len: int, max_model_len: int | None, kv_capacity_tokens: int) -> int:
    """The most tokens a prompt of ``prompt_len`` may generate here (< 1: none).

    The model's context holds prompt + output; the KV cache holds all but the
    last generated token (it is never fed back, so it needs no slot).
    """
    by_kv = kv_capacity_tokens - prompt_len + 1
    return by_kv if max_model_len is None else min(by_kv, max_model_len - prompt_len)


def check_request(
    token_ids: list[int] | array,
    request_id: str,
    params: SamplingParams,
    vocab_size: int,
    max_model_len: int | None,
    kv_capacity_tokens: int,
) -> None:
    where = f"request {request_id}"
    if not token_ids:
        raise RequestError(f"{where}: the prompt is empty")
    ids = np.asarray(token_ids)  # an array('i') through its buffer: microseconds for a 12,000-token prompt
    if not 0 <= ids.min() <= ids.max() < vocab_size:
        raise RequestError(f"{where}: token id {next(t for t in token_ids if not 0 <= t < vocab_size)} is outside the vocabulary (size {vocab_size})")
    if stops := [t for t in params.stop_token_ids if t >= vocab_size]:
        raise RequestError(f"{where}: stop token id {stops[0]} is outside the vocabulary (size {vocab_size})")
    n = len(token_ids)
    if max_model_len is not None and n >= max_model_len:
        raise RequestError(
            f"{where}: the prompt has {n} tokens, which leaves no room in the model's context of "
            f"{max_model_len} tokens"
        )
    if n > kv_capacity_tokens:
        raise RequestError(
            f"{where}: the prompt has {n} tokens but the whole KV cache holds {kv_capacity_tokens}; "
            "raise kv_cache.num_blocks"
        )
    m = params.max_new_tokens
    if max_model_len is not None and n + m > max_model_len:
        raise RequestError(
            f"{where}: the prompt's {n} tokens + max_new_tokens {m} exceed the model's context of "
            f"{max_model_len} tokens; lower max_new_tokens to {max_model_len - n} or less"
        )
    if m > max_new_tokens_limit(n, None, kv_capacity_tokens):
        raise RequestError(
            f"{where}: the prompt's {n} tokens + max_new_tokens {m} needs KV for {n + m - 1} tokens but the "
            f"whole cache holds {kv_capacity_tokens}; raise kv_cache.num_blocks or lower max_new_tokens"
        )
