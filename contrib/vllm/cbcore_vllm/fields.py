"""The per-request fields vLLM does not have (client id, deadline, attrs), read from ``vllm_xargs``.

Checked with cbcore's own rules (``RequestFields``: a non-empty str client id,
a finite positive deadline, JSON-only attrs), in one place for both readers:
the scheduler when a request arrives, and the API middleware before it does.
No vLLM import here, so the middleware and its tests need none.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from cbcore_vllm._cbcore import RequestFields, field_problems

# The keys of SamplingParams.extra_args (an OpenAI request's `vllm_xargs`) that reach policies.
XARGS = ("client_id", "deadline_s", "attrs")


class RequestFieldError(ValueError):
    """A request's ``vllm_xargs`` hold a client id, deadline or attrs cbcore would refuse."""


def check_xargs(extra: Mapping[str, Any]) -> tuple[str, float | None, Mapping[str, Any]]:
    """(client_id, deadline_s, attrs) from ``vllm_xargs``; RequestFieldError naming the bad field."""
    try:
        data = {key: extra[key] for key in XARGS if key in extra}
        if "attrs" in data:
            data["attrs"] = _attrs_object(data["attrs"])
        fields = RequestFields(**data)
    except ValueError as exc:  # a ValidationError is one too
        detail = field_problems(exc) if isinstance(exc, ValidationError) else str(exc)
        raise RequestFieldError(f"vllm_xargs: {detail}") from None
    return fields.client_id, fields.deadline_s, fields.attrs


def _attrs_object(value: Any) -> Any:
    """``attrs`` as sent: an object, or (over HTTP, where vllm_xargs values are scalars) its JSON text."""
    if not isinstance(value, str):
        return value
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"attrs must be a JSON object (or its JSON text), got unparsable text: {exc}") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"attrs must be a JSON object, got {type(parsed).__name__}")
    return parsed
