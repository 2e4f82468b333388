"""The model-free half of the engine: requests, the scheduler and per-step bookkeeping.

:class:`EngineCore` owns everything a step does around the forward pass: it
asks the scheduler for a plan, hands it to an :class:`Executor`, appends the
sampled tokens, finishes sequences, tells the scheduler, and reports outputs
and :class:`StepStats`. :class:`cbcore.engine.Engine` plugs in the model
(runner + sampler); the simulator (:mod:`cbcore.sim`) plugs in a cost model
and a virtual clock. Both therefore run the very same loop, so a policy
behaves identically in either.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from cbcore.config import EngineConfig
from cbcore.generate import run_batch
from cbcore.log import get_logger
from cbcore.outputs import RequestOutput
from cbcore.plugins import get_registry
from cbcore.request_checks import Prompt, RequestError, check_request, encode_prompt
from cbcore.scheduling.block_manager import BlockManager
from cbcore.scheduling.plan import StepPlan
from cbcore.scheduling.policy import StepResult
from cbcore.scheduling.policy_scheduler import PolicyScheduler
from cbcore.scheduling.request_fields import (
    FieldError,
    check_client_id,
    check_deadline,
    check_priority,
    check_request_id,
    freeze_attrs,
)
from cbcore.scheduling.rollback import TokenUndo
from cbcore.scheduling.sampling_params import SamplingParams
from cbcore.scheduling.scheduler import Scheduler, SchedulerOutput
from cbcore.scheduling.sequence import FinishReason, Sequence
from cbcore.stats import EngineLoad, StepStats, StepTotals
from cbcore.step_guard import StepGuard

log = get_logger(__name__)

__all__ = ["EngineCore", "Executor", "Prompt", "RequestError", "Sampled", "StepRecord", "build_scheduler"]


#: How many recent StepStats ``step_stats`` keeps.
STEP_STATS_KEPT = 1024

@dataclass(frozen=True)
class StepRecord:
    """Everything about one step, for listeners (the demo, benchmarks, tests)."""

    stats: StepStats
    output: SchedulerOutput
    batch: Any  # the executor's packed batch (a FlatBatch for the model), or None
    outputs: list[RequestOutput]


@dataclass
class Sampled:
    """What an executor produced: one token per sampling row of the plan."""

    rows: list[int]  # indices into SchedulerOutput.scheduled of the rows that sampled
    tokens: list[int]
    logprobs: list[dict[int, float] | None]
    # Per row, why its sampling failed (that request alone ends with an error), or None.
    errors: list[str | None] | None = None


class Executor(Protocol):
    """Runs a decided step. The engine times ``prepare`` and ``forward`` separately.

    ``prepare`` gets the scheduler's decision and the plan the engine checked
    and built from it (the rows to run); it must run that plan.
    """

    def prepare(self, out: SchedulerOutput, plan: StepPlan) -> Any: ...
    def forward(self, prepared: Any) -> Any: ...
    def sample(self, prepared: Any, forwarded: Any) -> Sampled: ...
    def batch_of(self, prepared: Any) -> Any: ...


def build_scheduler(
    config: EngineConfig, num_blocks: int, clock: Callable[[], float]
) -> tuple[Scheduler, dict[str, Any] | None]:
    """The configured scheduler over a fresh :class:`BlockManager`, and the composed policies (if any)."""
    registry = get_registry(tuple(config.plugins))
    sched = config.scheduler
    policies = None
    if sched.name is None:
        policies = {
            slot: registry.create(slot, spec.name, spec.params, f"scheduler.{slot}")
            for slot in ("queue", "budget", "prefill", "preemption")
            for spec in [getattr(sched, slot)]
        }
    host_blocks = config.kv_cache.num_host_blocks
    if host_blocks is None:  # swap space defaults to the size of the device pool
        swaps = policies is not None and policies["preemption"].mode == "swap"
        host_blocks = num_blocks if swaps else 0
    blocks = BlockManager(
        num_blocks, config.kv_cache.block_size, host_blocks, prefix_caching=config.kv_cache.prefix_caching
    )
    if policies is not None:
        return PolicyScheduler(**policies, blocks=blocks, clock=clock), policies
    return registry.create("scheduler", sched.name, sched.params, "scheduler", blocks), None


class EngineCore:
    """Continuous batching without a model: the loop, with the forward left to an executor."""

    def __init__(
        self,
        config: EngineConfig,
        executor: Executor,
        scheduler: Scheduler,
        *,
        vocab_size: int,
        max_model_len: int | None,
        eos_token_ids: Iterable[int] = (),
        tokenizer: Any | None = None,
        clock: Callable[[], float] = time.perf_counter,
        deltas: bool = True,
    ) -> None:
        self.config = config
        self.executor = executor
        self.scheduler = scheduler
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.tokenizer = tokenizer
        self.clock = clock
        # False: step() reports only requests that ended (a caller that never streams saves a copy
        # of every running request's tokens per step).
        self.deltas = deltas
        # The most recent steps only, so a long-running engine holds constant memory; whoever
        # needs every step (benchmarks, the demo) subscribes to step_listeners.
        self.step_stats: deque[StepStats] = deque(maxlen=STEP_STATS_KEPT)
        self.step_totals = StepTotals()
        self.step_listeners: list[Callable[[StepRecord], None]] = []
        self.num_preemptions_total = 0  # counted here, so that it holds for any Scheduler
        self._ids = itertools.count()
        self.guard = StepGuard(scheduler, config, clock)
        self._live: dict[str, Sequence] = {}  # every request added and not yet ended

    # -- requests ------------------------------------------------------------

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        client_id: str = "default",
        deadline_s: float | None = None,
        attrs: Mapping[str, Any] | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """Queue one request and return its id; raises :class:`RequestError` on bad input.

        ``priority``, ``client_id``, ``deadline_s`` (seconds after arrival) and
        ``attrs`` (JSON values) are what policies read to tell requests apart;
        they are checked strictly (no coercion) and ``attrs`` is stored as a
        read-only copy. Nothing is registered unless every check passes.
        ``cache_salt`` isolates the request's prefix cache: only requests with
        the same salt share KV blocks (e.g. one salt per tenant).
        """
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params must be SamplingParams, got {type(params).__name__}")
        if request_id is None:
            request_id = self.new_request_id()
        try:
            check_request_id(request_id)
            fields = dict(
                priority=check_priority(priority),
                client_id=check_client_id(client_id),
                deadline_s=check_deadline(deadline_s),
                attrs=freeze_attrs(attrs),
            )
        except FieldError as exc:
            raise RequestError(f"request {request_id!r}: {exc}") from None
        if arrival_time is not None and (
            isinstance(arrival_time, bool) or not isinstance(arrival_time, int | float)
        ):
            raise RequestError(f"request {request_id!r}: arrival_time must be a number, got {arrival_time!r}")
        if request_id in self._live:
            raise RequestError(f"request id {request_id!r} is already in use")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise RequestError(f"request {request_id!r}: cache_salt must be a string, got {type(cache_salt).__name__}")
        token_ids = encode_prompt(prompt, request_id, self.tokenizer)
        check_request(token_ids, request_id, params, self.vocab_size, self.max_model_len, self.scheduler.blocks)
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=token_ids,
            params=params,
            arrival_time=self.clock() if arrival_time is None else float(arrival_time),
            cache_salt=cache_salt,
            **fields,
        )
        self.guard.call(self.scheduler.add, seq)  # the composed scheduler registers all or nothing
        self._live[request_id] = seq
        return request_id

    def new_request_id(self) -> str:
        """An id no request of this engine has had (``req-N``)."""
        return f"req-{next(self._ids)}"

    def scheduler_has(self, request_id: str) -> bool:
        return request_id in self._live

    def abort(self, request_id: str) -> bool:
        """Cancel a request wherever it is; its KV blocks are freed at once."""
        seq = self.guard.call(self.scheduler.abort, request_id)
        if seq is not None:
            self._live.pop(request_id, None)
            log.info("request aborted", request_id=request_id, generated=seq.num_output_tokens)
        return seq is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def load(self) -> EngineLoad:
        """A snapshot of queue lengths, KV use and counters (read it between steps)."""
        sched = self.scheduler
        blocks = sched.blocks
        return EngineLoad(
            num_waiting=len(getattr(sched, "waiting", ())),
            num_running=len(getattr(sched, "running", ())),
            num_swapped=len(getattr(sched, "swapped", ())),
            kv_blocks_used=blocks.num_used_blocks,
            kv_blocks_total=blocks.num_blocks,
            num_preemptions_total=self.num_preemptions_total,
            prefix_cache_queries_tokens=getattr(blocks, "prefix_cache_queries_tokens", 0),
            prefix_cache_hits_tokens=getattr(blocks, "prefix_cache_hits_tokens", 0),
        )

    # -- the loop ------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one iteration; return a delta for every request that produced a token or ended.

        The plan is checked before anything runs (:mod:`cbcore.step_guard`). If
        anything in the step fails -- a plugin raises, the plan breaks a rule,
        the forward fails -- the step is undone before the exception
        propagates: the engine is as it was, and the error names the plugin.
        """
        blocks = self.scheduler.blocks
        queries0 = getattr(blocks, "prefix_cache_queries_tokens", 0)
        hits0 = getattr(blocks, "prefix_cache_hits_tokens", 0)
        t0 = self.clock()
        restore = self.guard.snapshot(self._live)
        undo = TokenUndo()
        try:
            out = self.guard.call(self.scheduler.schedule)
            plan = self.guard.check(out)
            t1 = self.clock()
            batch = None
            t2 = t3 = t1
            outputs: list[RequestOutput] = []
            if plan.rows:
                prepared = self.executor.prepare(out, plan)
                batch = self.executor.batch_of(prepared)
                t2 = self.clock()
                forwarded = self.executor.forward(prepared)
                t3 = self.clock()
                undo.save_rng(plan)
                outputs = self._postprocess(out, self.executor.sample(prepared, forwarded), undo)
        except BaseException as exc:
            undo.restore()
            restore()
            named = self.guard.named(exc)
            if named is exc:
                raise
            raise named from exc
        for seq in out.failed:
            self._live.pop(seq.request_id, None)
        outputs[:0] = [RequestOutput.of(seq, [], self._text(seq)) for seq in out.failed]
        self.num_preemptions_total += len(out.preempted)
        t4 = self.clock()
        stats = StepStats(
            step=self.step_totals.steps + 1,
            num_seqs=len(out.scheduled),
            num_tokens=out.num_tokens,
            num_prefill_tokens=out.num_prefill_tokens,
            num_decode_tokens=out.num_decode_tokens,
            num_preempted=len(out.preempted),
            kv_blocks_used=blocks.num_used_blocks,
            kv_blocks_total=blocks.num_blocks,
            prefix_cache_queries_tokens=getattr(blocks, "prefix_cache_queries_tokens", 0) - queries0,
            prefix_cache_hits_tokens=getattr(blocks, "prefix_cache_hits_tokens", 0) - hits0,
            schedule_s=t1 - t0,
            prepare_s=t2 - t1,
            forward_s=t3 - t2,
            sample_s=t4 - t3,
        )
        self.step_totals.add(stats)
        self.step_stats.append(stats)
        for listener in self.step_listeners:
            listener(StepRecord(stats, out, batch, outputs))
        return outputs

    def _postprocess(self, out: SchedulerOutput, sampled: Sampled, undo: TokenUndo) -> list[RequestOutput]:
        now = self.clock()
        new_token: dict[Sequence, int] = {}
        failed: list[Sequence] = []
        errors = sampled.errors or [None] * len(sampled.rows)
        for row, token, logprobs, error in zip(sampled.rows, sampled.tokens, sampled.logprobs, errors, strict=True):
            seq = out.scheduled[row].seq
            seq.num_computed_tokens = seq.num_tokens
            if error is not None:  # this request alone fails; the rest of the batch goes on
                seq.finish(FinishReason.ERROR, now, error)
                failed.append(seq)
                continue
            undo.appended.append((seq, seq.first_token_time is not None))
            seq.append_token(token, now)
            if logprobs is not None:
                seq.logprobs.append(logprobs)
            self._check_finish(seq, token, now)
            new_token[seq] = token
        results = []
        for item in out.scheduled:
            seq = item.seq
            if seq not in new_token and not seq.is_finished:  # a non-final prefill chunk
                seq.num_computed_tokens += item.num_tokens
            results.append(StepResult(seq, item.num_tokens, new_token.get(seq)))
        self.scheduler.on_step_end(out, results)
        for seq in (*new_token, *failed):
            if seq.is_finished:
                self._live.pop(seq.request_id, None)
        outputs = [
            RequestOutput.of(seq, [tok], self._text(seq))
            for seq, tok in new_token.items()
            if self.deltas or seq.is_finished
        ]
        return outputs + [RequestOutput.of(seq, [], self._text(seq)) for seq in failed]

    def _check_finish(self, seq: Sequence, token: int, now: float) -> None:
        params = seq.params
        if (not params.ignore_eos and token in self.eos_token_ids) or token in params.stop_token_ids:
            seq.finish(FinishReason.STOP, now)
        elif seq.num_output_tokens >= params.max_new_tokens or (
            self.max_model_len is not None and seq.num_tokens >= self.max_model_len
        ):
            seq.finish(FinishReason.LENGTH, now)

    # -- batch API -----------------------------------------------------------

    #: Run a list of prompts to completion (:func:`cbcore.generate.run_batch`).
    generate = run_batch

    # -- helpers -------------------------------------------------------------

    def _text(self, seq: Sequence) -> str | None:
        if self.tokenizer is None or not seq.is_finished:
            return None
        return self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
