"""cbcore's policy views over vLLM's own objects: a ``Request`` seen as a ``SequenceView``.

One view per request for its whole life, so that a policy keeping state by
identity (``seq in self.seen``) sees the same object in every event, as in cbcore's engine. The fields read vLLM's request
live; the per-request fields vLLM does not have (client id, deadline,
attributes) come from the request's ``vllm_xargs`` and are checked with
cbcore's own rules when the request arrives.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError
from vllm.sampling_params import SamplingParams as VllmSamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.request import Request

from cbcore_vllm._cbcore import RequestFields, SamplingParams, field_problems

# The keys of SamplingParams.extra_args (an OpenAI request's `vllm_xargs`) that reach policies.
XARGS = ("client_id", "deadline_s", "attrs")


class RequestFieldError(ValueError):
    """A request's ``vllm_xargs`` hold a client id, deadline or attrs cbcore would refuse."""


def policy_fields(params: VllmSamplingParams | None) -> tuple[str, float | None, Mapping[str, Any]]:
    """(client_id, deadline_s, attrs) from ``vllm_xargs``, checked by cbcore's own ``RequestFields``."""
    extra = (params.extra_args if params is not None else None) or {}
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


def cbcore_params(params: VllmSamplingParams | None) -> SamplingParams:
    """The request's decoding parameters in cbcore's type (what ``seq.params`` is to a policy)."""
    if params is None:
        return SamplingParams(max_new_tokens=1)
    return SamplingParams.model_construct(  # vLLM validated them; its ranges are wider than cbcore's
        max_new_tokens=params.max_tokens if params.max_tokens is not None else 16,
        temperature=float(params.temperature),
        top_k=max(int(params.top_k), 0),
        top_p=float(params.top_p),
        seed=params.seed,
        stop_token_ids=tuple(params.stop_token_ids or ()),
        ignore_eos=bool(params.ignore_eos),
        logprobs=params.logprobs,
    )


class RequestView:
    """A vLLM ``Request`` as cbcore's ``SequenceView`` (docs/policies.md lists the fields)."""

    __slots__ = (
        "_kv",
        "arrival_time",
        "attrs",
        "client_id",
        "deadline_s",
        "num_cached_prompt_tokens",
        "params",
        "queue_key",
        "request",
    )

    def __init__(self, request: Request, arrival_time: float, kv: KVCacheManager) -> None:
        self.request = request
        self._kv = kv
        self.arrival_time = arrival_time  # the adapter's clock, the one `now` is read from
        self.client_id, self.deadline_s, self.attrs = policy_fields(request.sampling_params)
        self.params = cbcore_params(request.sampling_params)
        self.num_cached_prompt_tokens = 0
        self.queue_key: Any = None  # stored at arrival for a queue whose keys never change

    @property
    def view(self) -> RequestView:
        """What cbcore's door hands a policy: this view itself."""
        return self

    def __repr__(self) -> str:
        return f"RequestView({self.request_id!r})"

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def priority(self) -> int:
        return self.request.priority

    @property
    def deadline(self) -> float | None:
        return None if self.deadline_s is None else self.arrival_time + self.deadline_s

    @property
    def num_prompt_tokens(self) -> int:
        return self.request.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return self.request.num_tokens

    @property
    def num_output_tokens(self) -> int:
        return self.request.num_output_tokens

    @property
    def num_computed_tokens(self) -> int:
        return self.request.num_computed_tokens

    @property
    def num_pending_tokens(self) -> int:
        return self.request.num_tokens - self.request.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        return self.num_pending_tokens > 1

    @property
    def num_preemptions(self) -> int:
        return self.request.num_preemptions

    @property
    def block_table(self) -> list[int]:
        # Read without get_block_ids(): its defaultdict would create an entry for a waiting request.
        blocks = self._kv.coordinator.single_type_managers[0].req_to_blocks.get(self.request.request_id, ())
        return [b.block_id for b in blocks]


class KVCacheView:
    """vLLM's KV cache manager as cbcore's ``KVView`` (its null block is not counted)."""

    def __init__(self, kv: KVCacheManager, block_size: int) -> None:
        self._kv = kv
        self.block_size = block_size
        self.num_blocks = kv.block_pool.num_gpu_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return self._kv.block_pool.get_num_free_blocks()

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_needed(self, seq: RequestView, num_new_tokens: int) -> int:
        have = len(seq.block_table)
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(total - have, 0)
