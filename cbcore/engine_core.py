"""The model-free half of the engine: requests, the scheduler and the step loop.

:class:`EngineCore` runs every step as plan -> run -> commit: the scheduler
plans, the step transaction (:mod:`cbcore.scheduling.step`) checks the plan,
an :class:`Executor` runs it, the transaction appends the sampled tokens, the
scheduler is told, and the engine reports outputs and :class:`StepStats`. When
a policy call fails about one request, the step is undone, that request ends
with an error, and the step is planned again without it. :class:`cbcore.engine.Engine` plugs in the model (runner +
sampler); the simulator (:mod:`cbcore.sim`) plugs in a cost model and a
virtual clock. Both run the very same loop, so a policy behaves identically
in either.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Protocol

from tqdm import tqdm

from cbcore.config import EngineConfig
from cbcore.log import get_logger
from cbcore.outputs import RequestOutput, StepStats, StepTotals
from cbcore.scheduling.door import PolicyError
from cbcore.scheduling.plan import Sampled, StepPlan
from cbcore.scheduling.policy_scheduler import build_scheduler
from cbcore.scheduling.request import Prompt, Request, RequestError, check_request, encode_prompt
from cbcore.scheduling.sampling_params import SamplingParams
from cbcore.scheduling.scheduler import Scheduler, SchedulerError, SchedulerOutput
from cbcore.scheduling.sequence import FinishReason, Sequence, SequenceStatus
from cbcore.scheduling.step import Steps, StepTransaction

log = get_logger(__name__)

__all__ = ["EngineCore", "Executor", "Prompt", "RequestError", "StepRecord", "build_scheduler"]

#: How many recent StepStats ``step_stats`` keeps.
STEP_STATS_KEPT = 1024
#: How many requests one step may end for failing policy calls before the engine stops instead.
MAX_REPLANS = 8
_NOTHING = Sampled([], [], [])


@dataclass(frozen=True)
class StepRecord:
    """Everything about one step, for listeners (the demo, benchmarks, tests)."""

    stats: StepStats
    output: SchedulerOutput
    batch: Any  # what the executor prepared (the model's FlatBatch, the simulator's StepShape), or None
    outputs: list[RequestOutput]


class Executor(Protocol):
    """Runs a checked plan, timed in three parts; ``sample`` gets the RNG states saved before it
    (to redo a row alone, with the draws it would get alone, if sampling the batch fails)."""

    def prepare(self, plan: StepPlan) -> Any: ...  # what forward runs (the model's packed batch, or the step's shape)
    def forward(self, prepared: Any) -> Any: ...
    def sample(self, prepared: Any, forwarded: Any, rng_states: list[tuple[Any, Any]]) -> Sampled: ...


class EngineCore:
    """Continuous batching without a model: the loop, with the forward left to an executor."""

    def __init__(
        self, config: EngineConfig, executor: Executor, scheduler: Scheduler, *, vocab_size: int,
        max_model_len: int | None, names: Mapping[int, str], eos_token_ids: Iterable[int] = (),
        tokenizer: Any | None = None, clock: Callable[[], float] = time.perf_counter, deltas: bool = True,
    ) -> None:  # fmt: skip
        self.config, self.executor, self.scheduler, self.tokenizer = config, executor, scheduler, tokenizer
        self.vocab_size, self.max_model_len, self.clock = vocab_size, max_model_len, clock
        self.eos_token_ids = frozenset(eos_token_ids)
        # False: step() reports only requests that ended (a caller that never streams saves a copy
        # of every running request's tokens per step).
        self.deltas = deltas
        # The most recent steps only, so a long-running engine holds constant memory; whoever
        # needs every step (benchmarks, the demo) subscribes to step_listeners.
        self.step_stats: deque[StepStats] = deque(maxlen=STEP_STATS_KEPT)
        self.step_totals = StepTotals()
        self.step_listeners: list[Callable[[StepRecord], None]] = []
        self._ids = itertools.count()
        door = getattr(scheduler, "door", None)
        culprit = door.culprit if door is not None else names.get(id(getattr(scheduler, "plugin", scheduler)))
        self.steps = Steps(scheduler, culprit or f"scheduler {type(scheduler).__name__}", clock,
                           self.eos_token_ids, max_model_len)  # fmt: skip
        self._live: dict[str, Sequence] = {}  # every request added and not yet ended

    # -- requests ------------------------------------------------------------

    def add_request(
        self, prompt: Prompt, params: SamplingParams | None = None, *, request_id: str | None = None,
        priority: int = 0, client_id: str = "default", deadline_s: float | None = None,
        attrs: Mapping[str, Any] | None = None, arrival_time: float | None = None, cache_salt: str | None = None,
    ) -> str:  # fmt: skip
        """Queue one request and return its id; raises :class:`RequestError` on bad input.

        ``priority``, ``client_id``, ``deadline_s`` (seconds after arrival) and
        ``attrs`` (JSON values) are what policies read to tell requests apart
        (:class:`~cbcore.scheduling.request.RequestFields`, checked strictly;
        ``attrs`` is stored as a read-only copy). Nothing is registered unless
        every check passes. ``cache_salt`` isolates the request's prefix cache:
        only requests with the same salt share KV blocks (e.g. one per tenant).
        """
        params = params if params is not None else SamplingParams()
        request_id = self.new_request_id() if request_id is None else request_id
        req = Request.checked(
            request_id=request_id, params=params, priority=priority, client_id=client_id, deadline_s=deadline_s,
            attrs=attrs, arrival_time=arrival_time, cache_salt=cache_salt,
        )  # fmt: skip
        if req.request_id in self._live:
            raise RequestError(f"request id {req.request_id!r} is already in use")
        token_ids = encode_prompt(prompt, req.request_id, self.tokenizer)
        check_request(token_ids, req.request_id, params, self.vocab_size, self.max_model_len, self.kv_capacity_tokens)
        seq = Sequence(
            req.request_id, token_ids, params, priority=req.priority, client_id=req.client_id,
            arrival_time=self.clock() if req.arrival_time is None else req.arrival_time, deadline_s=req.deadline_s,
            attrs=req.attrs, cache_salt=req.cache_salt,
        )  # fmt: skip
        self.scheduler.add(seq)  # all or nothing: a policy that raises on arrival leaves nothing registered
        self._live[req.request_id] = seq
        return req.request_id

    def new_request_id(self) -> str:
        """An id no request of this engine has had (``req-N``)."""
        return f"req-{next(self._ids)}"

    @property
    def kv_capacity_tokens(self) -> int:
        return self.scheduler.blocks.capacity_tokens

    def abort(self, request_id: str) -> bool:
        """Cancel a request wherever it is; its KV blocks are freed at once."""
        seq = self.scheduler.abort(request_id)
        self._live.pop(request_id, None)  # out of the engine's own count, whatever the scheduler still knew
        if seq is not None:
            log.info("request aborted", request_id=request_id, generated=seq.num_output_tokens)
        return seq is not None

    def has_unfinished(self) -> bool:
        return bool(self._live)  # the engine's own count: a scheduler plugin that loses a request cannot end it

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix no request holds (a benchmark's cold start); returns how many blocks."""
        return self.scheduler.blocks.reset_prefix_cache()

    @property
    def requests(self) -> Mapping[str, Sequence]:
        """Every request added and not yet ended, by id (read-only; read it between steps)."""
        return MappingProxyType(self._live)

    # -- the loop ------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one iteration: plan -> run -> commit; a delta for every request that produced a token or ended.

        If anything in the step fails, the step is undone first: the engine is
        as it was. A policy call that failed about one request ends that
        request with the error (its output says which policy and method) and
        the step is planned again without it; any other failure propagates,
        naming the plugin when a plugin caused it (``SchedulerError``).
        """
        blocks = self.scheduler.blocks
        queries0, hits0 = blocks.prefix_cache_queries_tokens, blocks.prefix_cache_hits_tokens
        t0 = self.clock()
        ended: list[Sequence] = []  # requests a failing policy call ended; the step ran without them
        while True:
            tx = StepTransaction(self.steps, self._live.values())
            try:
                out = self.scheduler.schedule()
                plan = tx.check(out)
                t1 = t2 = t3 = self.clock()
                prepared, sampled = None, _NOTHING
                if plan.rows:
                    prepared = self.executor.prepare(plan)
                    t2 = self.clock()
                    forwarded = self.executor.forward(prepared)
                    t3 = self.clock()
                    sampled = self.executor.sample(prepared, forwarded, tx.rng)
                new_token, failed, results = tx.commit(sampled)
                late = self.scheduler.on_step_end(out, results) or ()  # the events: after the commit
                break
            except BaseException as exc:
                tx.undo()
                rid = exc.request_id if isinstance(exc, SchedulerError) else None
                if rid is None or rid not in self._live:
                    raise
                if len(ended) == MAX_REPLANS:
                    raise SchedulerError(f"{exc}; the step failed {MAX_REPLANS + 1} times in a row, each time for "
                                         "another request: the engine stops", plugin=exc.plugin, rule=exc.rule) from exc
                ended.append(self._end(rid, exc))
        for err in late:  # an event failed after the commit: its request ends, nothing is planned again
            if err.request_id is None:
                raise err
            if (seq := self._live.get(err.request_id)) is not None and not seq.is_finished:
                ended.append(self._end(err.request_id, err))  # (one that finished keeps its result)
        outputs = self._outputs(new_token, [*out.failed, *failed, *(s for s in ended if s not in new_token)])
        stats = StepStats(
            step=self.step_totals.steps + 1,
            num_seqs=len(out.scheduled),
            num_tokens=plan.num_tokens,
            num_decode_tokens=plan.num_decode_tokens,
            num_preempted=len(out.preempted),
            kv_blocks_used=blocks.num_used_blocks,
            kv_blocks_total=blocks.num_blocks,
            prefix_cache_queries_tokens=blocks.prefix_cache_queries_tokens - queries0,
            prefix_cache_hits_tokens=blocks.prefix_cache_hits_tokens - hits0,
            schedule_s=t1 - t0,
            prepare_s=t2 - t1,
            forward_s=t3 - t2,
            sample_s=self.clock() - t3,
        )
        self.step_totals.add(stats)
        self.step_stats.append(stats)
        for listener in self.step_listeners:
            listener(StepRecord(stats, out, prepared, outputs))
        return outputs

    def _end(self, request_id: str, err: SchedulerError) -> Sequence:
        """End a request a plugin failed on: the client sees which plugin and method, the log everything."""
        seq = self._live.pop(request_id)  # out of any later undo of this step
        seq.error = getattr(err, "public", None) or f"{err.plugin.split(' (')[0]} broke the rule '{err.rule}'"
        log.error("request ended: a plugin failed on it", request_id=request_id, plugin=err.plugin, rule=err.rule,
                  error=str(err), exc_info=err)  # fmt: skip
        self.scheduler.abort(request_id)
        if seq.finish_reason is not FinishReason.ERROR:  # a whole-scheduler plugin ends it as an abort
            seq.finish(FinishReason.ERROR, self.clock(), seq.error)
        return seq

    def _outputs(self, new_token: dict[Sequence, int], ended: list[Sequence]) -> list[RequestOutput]:
        finished = SequenceStatus.FINISHED
        for seq in (*new_token, *ended):
            if seq.status is finished:  # its events are over: no reference cycle with its view keeps it for the gc
                self._live.pop(seq.request_id, None)
                seq.__dict__.pop("view", None)
        outputs = [
            RequestOutput.of(seq, [tok], self._text(seq))
            for seq, tok in new_token.items()
            if self.deltas or seq.status is finished
        ]
        return outputs + [RequestOutput.of(seq, [], self._text(seq)) for seq in ended]

    def _text(self, seq: Sequence) -> str | None:
        if self.tokenizer is None or not seq.is_finished:
            return None
        return self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)

    # -- batch API -----------------------------------------------------------

    def generate(
        self,
        prompts: Seq[Prompt],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        priorities: int | Seq[int] | None = None,
        client_ids: str | Seq[str] | None = None,
        deadlines_s: float | Seq[float | None] | None = None,
        attrs: Mapping[str, Any] | Seq[Mapping[str, Any] | None] | None = None,
        progress: bool = False,
    ) -> list[RequestOutput]:
        """Run ``prompts`` to completion; outputs in prompt order. Per-request arguments: one value or one per prompt.

        A refused prompt (empty, too long, a bad field) yields ``finish_reason="error"`` with the reason,
        one aborted meanwhile (by a step listener, say) ``"abort"``; the others run normally. If a step
        raises, this call's requests are aborted first, so the engine is idle and reusable.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            raise TypeError("generate() takes a list of prompts (strings or token-id lists)")
        if self.has_unfinished():
            raise RuntimeError("generate() needs an idle engine; drive pending requests with step()")
        columns = zip(*(_expand(value, len(prompts), *what) for value, what in (
            (params, ("params", SamplingParams, SamplingParams())), (priorities, ("priorities", int, 0)),
            (client_ids, ("client_ids", str, "default")), (deadlines_s, ("deadlines_s", int | float, None)),
            (attrs, ("attrs", Mapping, None)))), strict=True)  # fmt: skip
        ids: list[str] = []
        seqs: dict[str, Sequence] = {}
        done: dict[str, RequestOutput] = {}
        try:
            for prompt, (p, prio, client, deadline, extra) in zip(prompts, columns, strict=True):
                request_id = self.new_request_id()
                ids.append(request_id)
                try:
                    self.add_request(prompt, p, request_id=request_id, priority=prio, client_id=client,
                                     deadline_s=deadline, attrs=extra)  # fmt: skip
                    seqs[request_id] = self._live[request_id]
                except (RequestError, PolicyError) as exc:  # bad input, or a policy failed on its arrival
                    log.warning("request rejected", request_id=request_id, error=str(exc))
                    prompt_ids = prompt if isinstance(prompt, list) else []
                    done[request_id] = RequestOutput.rejected(request_id, list(prompt_ids), str(exc))
            bar = tqdm(total=len(seqs), unit="req", desc="generate", disable=not progress)
            while self.has_unfinished():
                for output in self.step():
                    if output.finished:
                        done[output.request_id] = output
                        bar.update(1)
            bar.close()
        except BaseException:
            for request_id in seqs:
                if request_id not in done:
                    try:
                        self.abort(request_id)
                    except Exception as exc:  # the first error is the one to report
                        log.error("abort failed", request_id=request_id, error=str(exc))
            raise
        # A request aborted while the loop ran ended without a step reporting it.
        return [done[i] if i in done else RequestOutput.of(seqs[i], [], self._text(seqs[i])) for i in ids]


def _expand(value: Any, n: int, what: str, single: Any, default: Any) -> list[Any]:
    """One value per prompt from ``value``: None (the default), one value, or a list of ``n``."""
    if value is None:
        return [default] * n
    if isinstance(value, single):  # a wrong type is refused per request by add_request
        return [value] * n
    if isinstance(value, str | bytes | Mapping):
        raise TypeError(f"{what}: expected one value or a list of {n}, got {type(value).__name__}")
    value = list(value)
    if len(value) != n:
        raise ValueError(f"{what}: got {len(value)} values for {n} prompts")
    return value
