"""cbcore's policy views over vLLM's own objects: a ``Request`` seen as a ``SequenceView``.

One view per request for its whole life, so that a policy keeping state by
identity (``seq in self.seen``) or in ``seq.policy_state`` sees the same
object in every event, as in cbcore's engine. The fields read vLLM's request
live; the per-request fields vLLM does not have (client id, deadline,
attributes) come from the request's ``vllm_xargs`` and are checked with
cbcore's own rules when the request arrives (``fields.py``).

Under async scheduling a request's fields are vLLM's own accounting when the
next step is planned: ``num_computed_tokens`` already counts the step in
flight (vLLM advances it when it schedules), ``num_output_tokens`` counts only
the tokens delivered, and ``num_pending_tokens`` what is left to schedule
(including the token the step in flight will sample). Synchronous, nothing is
in flight and these are cbcore's meanings exactly.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

from vllm.sampling_params import SamplingParams as VllmSamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.request import Request

from cbcore_vllm._cbcore import SamplingParams
from cbcore_vllm.fields import check_xargs

if TYPE_CHECKING:
    from cbcore_vllm.shim import V0_32

def policy_fields(params: VllmSamplingParams | None) -> tuple[str, float | None, Mapping[str, Any]]:
    """(client_id, deadline_s, attrs) from the request's ``vllm_xargs``, checked by cbcore's own rules."""
    return check_xargs((params.extra_args if params is not None else None) or {})


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
        "_blocks",
        "arrival_time",
        "attrs",
        "client_id",
        "deadline_s",
        "num_cached_prompt_tokens",
        "num_prompt_tokens",
        "params",
        "policy_state",
        "priority",
        "request",
        "request_id",
    )

    def __init__(self, request: Request, arrival_time: float, kv: KVCacheManager, internals: V0_32) -> None:
        self.request = request
        # What never changes is copied once: policies read these in every order() and key().
        self.request_id: str = request.request_id
        self.priority: int = request.priority
        self.num_prompt_tokens: int = request.num_prompt_tokens
        self._blocks = partial(internals.block_ids, kv, request.request_id)
        self.arrival_time = arrival_time  # the adapter's clock, the one `now` is read from
        self.client_id, self.deadline_s, self.attrs = policy_fields(request.sampling_params)
        self.params = cbcore_params(request.sampling_params)
        self.num_cached_prompt_tokens = 0
        self.policy_state: dict[str, object] = {}

    def __repr__(self) -> str:
        return f"RequestView({self.request_id!r})"

    @property
    def deadline(self) -> float | None:
        return None if self.deadline_s is None else self.arrival_time + self.deadline_s

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
        request = self.request  # async: the token the step in flight samples is a placeholder, still to feed
        return request.num_tokens + request.num_output_placeholders - request.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        return self.num_pending_tokens > 1

    @property
    def num_preemptions(self) -> int:
        return self.request.num_preemptions

    @property
    def block_table(self) -> list[int]:
        return self._blocks()


class KVCacheView:
    """vLLM's KV cache manager as cbcore's ``KVView`` (its null block is not counted)."""

    def __init__(self, kv: KVCacheManager, block_size: int, internals: V0_32) -> None:
        self._free = partial(internals.num_free_blocks, kv)
        self.block_size = block_size
        self.num_blocks = internals.num_usable_blocks(kv)

    @property
    def num_free_blocks(self) -> int:
        return self._free()

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_needed(self, seq: RequestView, num_new_tokens: int) -> int:
        have = len(seq.block_table)
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(total - have, 0)
