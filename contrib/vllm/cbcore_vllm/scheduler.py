"""``cbcore_vllm.Scheduler``: vLLM's v1 scheduler with cbcore's policies deciding.

A subclass of vLLM's ``AsyncScheduler`` (what vLLM asks custom schedulers to
extend), so it serves under vLLM's default async scheduling and under
``--no-async-scheduling`` alike. It overrides as little as possible; vLLM
keeps its own mechanism (KV blocks, prefix cache, chunking, outputs). What
the policies decide and where it enters vLLM's ``schedule()``:

* waiting order  -- the waiting queues are :class:`PolicyRequestQueue`\\ s,
  ordered by the queue policy every step and filtered by the budget's
  ``may_admit``;
* running order  -- ``self.running`` is re-sorted every step as cbcore's
  decode-first phase walks it (decodes, then ongoing prefills, each in queue
  order), which is also the order vLLM's running loop serves it in;
* the victim     -- ``self.running`` is a :class:`VictimList` whose victim read
  answers with the preemption policy's choice among the requests not yet
  scheduled this step;
* step limits    -- the budget's ``limits()`` every step, clamped to vLLM's
  ``--max-num-seqs`` / ``--max-num-batched-tokens``;
* prefill chunks -- translated once into vLLM's chunking knobs (policies.py).

Events: ``on_arrival`` (add_request), ``on_step_end`` (with the requests
preempted in the step) then ``on_finish`` (update_from_output), ``on_finish``
on abort. Synchronous, that is cbcore's engine's order. Async, vLLM plans step N+1
before step N's results arrive, so ``on_step_end`` for step N comes after
step N+1 was planned (docs/vllm.md, "Async scheduling"). Every read of vLLM's
private internals goes through the version's section in ``shim.py``.

Policies are asked through cbcore's door, as in cbcore's engine. A policy
failing about one request ends that request alone, with the error, through
vLLM's per-request error path (``shim.finish_with_error``: at the next
``update_from_output``); the step goes on without it and vLLM's engine serves
the others. A failure that concerns no single request (``limits()``) stops
vLLM's engine, naming the plugin.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from typing import Any

import structlog
import vllm
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request

from cbcore_vllm._cbcore import ConfigError, LazyViews, PolicyError, SchedulerState, StepResult
from cbcore_vllm.config import StepClock, parse
from cbcore_vllm.fields import RequestFieldError
from cbcore_vllm.policies import build, chunking, refuse_unsupported
from cbcore_vllm.refusal import Refusals
from cbcore_vllm.running import VictimList
from cbcore_vllm.shim import for_version
from cbcore_vllm.views import KVCacheView, RequestView

log = structlog.get_logger(__name__)


class Scheduler(AsyncScheduler):
    """vLLM's scheduler, with order, victims and limits from a cbcore ``scheduler:`` config."""

    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        config, adapter = parse(vllm_config.additional_config)  # before any work: a bad config fails first
        self._vllm = for_version(vllm.__version__, adapter.allow_untested_vllm)
        sc = vllm_config.scheduler_config
        self._policies = build(config)
        refuse_unsupported(self._policies, config)
        chunks = chunking(self._policies, sc.max_num_batched_tokens, vllm_config.model_config.max_model_len)
        if sc.long_prefill_token_threshold not in (0, chunks.long_prefill_token_threshold):
            raise ConfigError(
                f"--long-prefill-token-threshold {sc.long_prefill_token_threshold} conflicts with "
                f"{self._policies.names[id(self._policies.prefill)]}, which decides the prefill chunk; leave it unset"
            )
        sc.enable_chunked_prefill = chunks.enable_chunked_prefill
        sc.long_prefill_token_threshold = chunks.long_prefill_token_threshold
        super().__init__(vllm_config, *args, **kwargs)

        # Results are built for on_step_end only when a policy listens (the base class's is a no-op).
        self._hears_step_end = bool(self._policies.hearing["on_step_end"])
        self._failing: set[str] = set()  # requests a policy failed on: they end at the next update_from_output
        self._preempted: list[RequestView] = []  # this step's, for on_step_end
        self._queues = self._vllm.install(self, self._order_requests)
        self._clock_step_s = adapter.clock.step_s if isinstance(adapter.clock, StepClock) else None
        self._step = 0
        self._now = self._read_clock()
        self._views: dict[str, RequestView] = {}
        self._kv_view = KVCacheView(self.kv_cache_manager, self.block_size, self._vllm)
        self._vllm_max_seqs, self._vllm_max_tokens = self._vllm.limits(self)
        self._refusals = Refusals(self._vllm)
        self._clamp_noted = False
        self._finished_in_update: dict[str, RequestView] | None = None
        self.tracer: Any = None  # set by `python -m cbcore_vllm.check` to record each decision
        log.info(
            "cbcore policies decide in vLLM's scheduler",
            vllm=vllm.__version__,
            async_scheduling=bool(sc.async_scheduling),
            policies=[self._policies.names[id(p)] for p in self._policies.policies],
            chunked_prefill=chunks.enable_chunked_prefill,
            long_prefill_token_threshold=chunks.long_prefill_token_threshold,
            clock="wall" if self._clock_step_s is None else f"{self._clock_step_s} s per step",
        )

    # -- time and ordering ---------------------------------------------------

    def _read_clock(self) -> float:
        return time.monotonic() if self._clock_step_s is None else self._step * self._clock_step_s

    def _failed(self, err: PolicyError) -> None:
        """A policy failed about one request: it ends alone, with the error; about none, vLLM's engine stops."""
        rid = err.request_id
        if rid is None or rid not in self.requests:
            raise err
        if rid not in self._failing:
            log.error("request ended: a plugin failed on it", request_id=rid, plugin=err.plugin, error=str(err))
            self._failing.add(rid)
            self._vllm.finish_with_error(self, rid, "plugin_error", err.public)

    def _order_requests(self, requests: list[Request]) -> list[Request]:
        """In the queue policy's order, without the requests a policy failed on (each failure drops one)."""
        views = self._views
        live = [views[r.request_id] for r in requests if r.request_id not in self._failing]
        while True:
            try:
                return [v.request for v in self._policies.order(live, self._now)]
            except PolicyError as err:
                self._failed(err)
                live = [v for v in live if v.request_id != err.request_id]

    def _admits(self, request: Request) -> bool:
        if request.request_id in self._failing:
            return False
        try:
            return self._policies.may_admit(self._views[request.request_id], self._state)
        except PolicyError as err:
            self._failed(err)
            return False

    def _choose_victim(self, candidates: list[Request]) -> Request:
        """The policy's victim among the asker (first) and the running requests after it; alone, the asker."""
        views = [self._views[r.request_id] for r in candidates]
        while len(views) > 1:  # as in cbcore, the policy is asked only when there is a choice
            try:
                victim = self._policies.victim(views, self._now).request
                break
            except PolicyError as err:
                self._failed(err)
                views = [v for v in views if v.request_id != err.request_id]
        else:
            victim = views[0].request if views else candidates[0]
        if self.tracer is not None:
            self.tracer.victim(self._step, victim.request_id, candidates[0].request_id, len(candidates) - 1)
        return victim

    # -- one step ------------------------------------------------------------

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        if self.running or self.get_num_unfinished_requests():  # a call only to flush finished ids is no step
            self._step += 1
        self._now = self._read_clock()
        views = self._views
        running = self.running
        self._state = SchedulerState(
            now=self._now,
            step=self._step,
            waiting=LazyViews(lambda: [views[r.request_id] for r in self.waiting.ordered()]),
            running=tuple(views[r.request_id] for r in running),
            swapped=(),
            kv=self._kv_view,
        )
        limits = self._policies.limits(self._state)  # about no single request: a failure stops vLLM's engine
        clamped = limits.max_num_tokens > self._vllm_max_tokens or limits.max_num_seqs > self._vllm_max_seqs
        if clamped and not self._clamp_noted:
            self._clamp_noted = True
            log.warning(
                "the budget's limits exceed vLLM's; vLLM's apply (its model runner is sized by them)",
                budget=self._policies.names[id(self._policies.budget)],
                budget_limits=(limits.max_num_seqs, limits.max_num_tokens),
                vllm_limits=(self._vllm_max_seqs, self._vllm_max_tokens),
            )
        self._vllm.set_limits(
            self, min(self._vllm_max_seqs, limits.max_num_seqs), min(self._vllm_max_tokens, limits.max_num_tokens)
        )
        if self.tracer is not None:
            self.tracer.planning(self, self._step, limits, clamped)
        decodes: list[Request] = []
        prefills: list[Request] = []
        for r in self._order_requests(list(running)):  # RequestView.is_prefilling, inlined (once per request)
            (prefills if r.num_tokens + r.num_output_placeholders - r.num_computed_tokens > 1 else decodes).append(r)
        self.running = self._vllm.victim_list(decodes + prefills, self._choose_victim)
        was_waiting = [r for q in self._queues for r in q.members()]
        for queue in self._queues:
            queue.begin_step(self._admits)
        try:
            out = super().schedule(throttle_prefills)
        finally:
            for queue in self._queues:
                queue.end_step()
            if isinstance(self.running, VictimList):
                self.running.settle()
        scheduled = out.num_scheduled_tokens
        for request in was_waiting:  # admitted: what its cache lookup found is now behind num_computed
            if (n := scheduled.get(request.request_id)) is not None:
                object.__setattr__(views[request.request_id], "_cached", request.num_computed_tokens - n)
        if self.tracer is not None:
            self.tracer.scheduled(self._step, out)
        return out

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        scheduled = scheduler_output.num_scheduled_tokens
        self._refusals.hand_to(self)
        self._finished_in_update = {}
        try:
            outputs = super().update_from_output(scheduler_output, model_runner_output)
            finished = self._finished_in_update
        finally:
            self._finished_in_update = None
        preempted, self._preempted = self._preempted, []
        if self._hears_step_end:
            results = self._results(scheduled, outputs, finished)
            results += [StepResult(seq=view, num_computed=0, new_token=None, preempted=True) for view in preempted]
            for err in self._policies.step_ended(results, self._now):  # after the step: its request ends
                if err.request_id not in finished:
                    self._failed(err)
        for view in finished.values():
            self._tell_finish(view)
        self._failing.intersection_update(self.requests)
        return outputs

    def _results(
        self, scheduled: dict[str, int], outputs: dict[int, EngineCoreOutputs], finished: dict[str, RequestView]
    ) -> list[StepResult]:
        """A StepResult per request of the step, with the token it sampled (from vLLM's outputs of the step)."""
        sampled = {o.request_id: o.new_token_ids[-1] for eco in outputs.values() for o in eco.outputs if o.new_token_ids}
        results: list[StepResult] = []
        views = self._views
        for rid, n in scheduled.items():
            view = views.get(rid) or finished.get(rid)
            if view is not None:  # None: finished in an earlier update (async: already in this step's plan)
                results.append(StepResult(seq=view, num_computed=n, new_token=sampled.get(rid)))
        return results

    # -- events --------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:  # a streaming session's next chunk: not a new arrival
            super().add_request(request)
            return
        now = self._read_clock()
        try:
            view = RequestView(request, now, self.kv_cache_manager, self._vllm)
        except RequestFieldError as exc:
            self._refusals.refuse(self, request, "validation_error", str(exc))
            return
        try:  # as in cbcore: if a policy raises, the request is not added and those told see it finish
            if self._policies.fixed_keys:
                object.__setattr__(view, "queue_key", self._policies.key(view, now))
            self._policies.arrived(view, now)
        except PolicyError as err:
            log.error("request refused: a plugin failed on it", request_id=request.request_id, error=str(err))
            self._refusals.refuse(self, request, "plugin_error", err.public)
            return
        self._views[request.request_id] = view
        super().add_request(request)

    def _preempt_request(self, request: Request, timestamp: float, drop_stale_output: bool = False) -> None:
        super()._preempt_request(request, timestamp, drop_stale_output)
        self._preempted.append(self._views[request.request_id])

    def _free_request(self, request: Request, delay_free_blocks: bool = False) -> Any:
        result = super()._free_request(request, delay_free_blocks)
        view = self._views.pop(request.request_id, None)
        if view is not None:
            if self._finished_in_update is not None:  # told after on_step_end, as cbcore's engine does
                self._finished_in_update[view.request_id] = view
            else:  # an abort between steps
                self._tell_finish(view)
        return result

    def _tell_finish(self, view: RequestView) -> None:
        self._policies.finished(view, self._read_clock())  # a failure is logged: the request has ended

    def get_num_unfinished_requests(self) -> int:
        # A refused request still needs one step to be reported finished (with an error).
        return super().get_num_unfinished_requests() + self._refusals.pending

    @property
    def views(self) -> Seq[RequestView]:
        """The live requests as the policies see them."""
        return tuple(self._views.values())
