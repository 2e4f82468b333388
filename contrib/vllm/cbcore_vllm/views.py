"""cbcore's policy views over vLLM's own objects: a ``Request`` seen as a ``SequenceView``.

One view per request for its whole life, so that a policy keeping state by
identity (``seq in self.seen``) sees the same
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
        "_cached",
        "_request",
        "arrival_time",
        "attrs",
        "client_id",
        "deadline_s",
        "num_prompt_tokens",
        "params",
        "priority",
        "prompt_token_ids",
        "queue_key",
        "request_id",
    )

    def __init__(self, request: Request, arrival_time: float, kv: KVCacheManager, internals: V0_32) -> None:
        put = object.__setattr__  # read-only for policies, as cbcore's own views: written here only
        put(self, "_request", request)
        # What never changes is copied once: policies read these in every order() and key().
        put(self, "request_id", request.request_id)
        put(self, "priority", request.priority)
        put(self, "num_prompt_tokens", request.num_prompt_tokens)
        put(self, "prompt_token_ids", tuple(request.prompt_token_ids or ()))
        put(self, "_blocks", partial(internals.block_ids, kv, request.request_id))
        put(self, "arrival_time", arrival_time)  # the adapter's clock, the one `now` is read from
        client_id, deadline_s, attrs = policy_fields(request.sampling_params)
        put(self, "client_id", client_id)
        put(self, "deadline_s", deadline_s)
        put(self, "attrs", attrs)
        put(self, "params", cbcore_params(request.sampling_params))
        put(self, "_cached", 0)
        put(self, "queue_key", None)  # stored at arrival for a queue whose keys never change (the adapter's)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"a policy cannot set {name!r}: requests are read-only for policies; keep "
                             "per-request state on the policy itself, keyed by request_id")  # fmt: skip

    def __repr__(self) -> str:
        return f"RequestView({self.request_id!r})"

    @property
    def request(self) -> Request:
        """vLLM's request: the adapter's, never a policy's (like the underscored attributes of cbcore's views)."""
        return self._request

    @property
    def view(self) -> RequestView:
        """What cbcore's door hands a policy: this view itself."""
        return self

    @property
    def num_cached_prompt_tokens(self) -> int:
        """Tokens vLLM's prefix cache held at admission (0 while waiting: vLLM looks up only when admitting)."""
        return self._cached

    @property
    def output_token_ids(self) -> tuple[int, ...]:
        return tuple(self._request.output_token_ids)

    @property
    def deadline(self) -> float | None:
        return None if self.deadline_s is None else self.arrival_time + self.deadline_s

    @property
    def num_tokens(self) -> int:
        return self._request.num_tokens

    @property
    def num_output_tokens(self) -> int:
        return self._request.num_output_tokens

    @property
    def num_computed_tokens(self) -> int:
        return self._request.num_computed_tokens

    @property
    def num_pending_tokens(self) -> int:
        request = self._request  # async: the token the step in flight samples is a placeholder, still to feed
        return request.num_tokens + request.num_output_placeholders - request.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        return self.num_pending_tokens > 1

    @property
    def num_preemptions(self) -> int:
        return self._request.num_preemptions

    @property
    def block_table(self) -> tuple[int, ...]:
        return tuple(self._blocks())


class KVCacheView:
    """vLLM's KV cache manager as cbcore's ``KVView`` (its null block is not counted)."""

    __slots__ = ("_free", "block_size", "num_blocks")

    def __init__(self, kv: KVCacheManager, block_size: int, internals: V0_32) -> None:
        put = object.__setattr__
        put(self, "_free", partial(internals.num_free_blocks, kv))
        put(self, "block_size", block_size)
        put(self, "num_blocks", internals.num_usable_blocks(kv))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"a policy cannot set {name!r}: the KV cache is read-only for policies")

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
