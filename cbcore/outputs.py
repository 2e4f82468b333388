"""What the engine hands back: per-request outputs and their latency metrics, per-step statistics."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from operator import attrgetter

from cbcore.scheduling.sequence import Prefix, Sequence

#: The Sequence attributes behind RequestMetrics' fields, in field order.
_METRIC_FIELDS = attrgetter(
    "arrival_time", "first_scheduled_time", "first_token_time", "token_times", "finish_time", "num_preemptions",
    "num_prompt_tokens", "num_output_tokens", "prefix_cache_queries", "prefix_cache_hits",
)


@dataclass(frozen=True)
class RequestMetrics:
    """Timestamps (``time.perf_counter`` seconds) and the latencies derived from them.

    Definitions follow vLLM's benchmark: TTFT from arrival to the first token,
    ITL the gaps between consecutive tokens, TPOT = (e2e - TTFT) / (n - 1).
    """

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    token_times: tuple[float, ...]
    finish_time: float | None
    num_preemptions: int
    prompt_len: int
    output_len: int
    # Prefix cache, over every admission of the request (a recompute preemption admits it again):
    # tokens it had to prefill, and how many of them the cache held.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0

    @classmethod
    def of(cls, seq: Sequence) -> RequestMetrics:
        """The sequence's own fields, in this class's field order (``token_times`` copied)."""
        values = _METRIC_FIELDS(seq)
        return cls(*values[:3], tuple(values[3]), *values[4:])

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.token_times)]

    @property
    def e2e(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        if self.output_len < 2 or self.e2e is None or self.ttft is None:
            return None
        return (self.e2e - self.ttft) / (self.output_len - 1)


@dataclass(frozen=True)
class RequestOutput:
    """One request's state as seen by the caller.

    From :meth:`Engine.step` it is a delta (``new_token_ids`` are the tokens
    produced by that step); from :meth:`Engine.generate` it is final.
    """

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    text: str | None = None
    error: str | None = None
    metrics: RequestMetrics | None = None
    logprobs: list[dict[int, float]] | None = field(default=None, repr=False)

    @classmethod
    def of(cls, seq: Sequence, new_token_ids: list[int], text: str | None = None) -> RequestOutput:
        return cls(
            request_id=seq.request_id,
            prompt_token_ids=p if isinstance(p := seq.prompt_token_ids, Prefix) else list(p),  # an array prompt: its view
            output_token_ids=seq.output_token_ids,
            new_token_ids=new_token_ids,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason.value if seq.finish_reason else None,
            text=text,
            error=seq.error,
            metrics=RequestMetrics.of(seq),
            logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
        )

    @classmethod
    def rejected(cls, request_id: str, prompt_token_ids: list[int], error: str) -> RequestOutput:
        """A request refused before it ever ran (bad input)."""
        return cls(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            output_token_ids=[],
            new_token_ids=[],
            finished=True,
            finish_reason="error",
            error=error,
        )

@dataclass(frozen=True)
class StepStats:
    step: int
    num_seqs: int
    num_tokens: int
    num_decode_tokens: int
    num_preempted: int
    kv_blocks_used: int
    kv_blocks_total: int
    schedule_s: float  # the scheduler's decision
    prepare_s: float  # swaps and packing the FlatBatch
    forward_s: float  # the model forward (attention included)
    sample_s: float  # sampling, stop checks, bookkeeping, outputs
    # Prefix cache: tokens of the prompts admitted this step, and how many of them the cache held.
    prefix_cache_queries_tokens: int = 0
    prefix_cache_hits_tokens: int = 0

    @property
    def total_s(self) -> float:
        return self.schedule_s + self.prepare_s + self.forward_s + self.sample_s

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_tokens - self.num_decode_tokens

    @property
    def is_mixed(self) -> bool:
        """Prefill and decode tokens shared this step's forward."""
        return self.num_prefill_tokens > 0 and self.num_decode_tokens > 0


@dataclass
class StepTotals:
    """Running counts over every step an engine ran (constant size, unlike a list of steps)."""

    steps: int = 0
    mixed_steps: int = 0
    preemptions: int = 0
    max_seqs: int = 0

    def add(self, s: StepStats) -> None:
        self.steps += 1
        self.mixed_steps += s.is_mixed
        self.preemptions += s.num_preempted
        self.max_seqs = max(self.max_seqs, s.num_seqs)
