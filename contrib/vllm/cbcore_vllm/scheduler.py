"""``cbcore_vllm.Scheduler``: vLLM 0.32.0's v1 scheduler with cbcore's policies deciding.

A subclass that overrides as little as possible; vLLM keeps its own
mechanism (KV blocks, prefix cache, chunking, outputs). What the policies
decide and where it enters vLLM's ``schedule()``:

* waiting order  -- ``self.waiting`` is a :class:`PolicyRequestQueue`, ordered
  by the queue policy every step and filtered by the budget's ``may_admit``;
* running order  -- ``self.running`` is re-sorted every step as cbcore's
  decode-first phase walks it (decodes, then ongoing prefills, each in queue
  order), which is also the order vLLM's running loop serves it in;
* the victim     -- ``self.running`` is a :class:`VictimList` whose ``[-1]`` /
  ``pop()`` answer with the preemption policy's choice among the requests not
  yet scheduled this step (vLLM is kept on its fcfs victim path for that);
* step limits    -- the budget's ``limits()`` every step, clamped to vLLM's
  ``--max-num-seqs`` / ``--max-num-batched-tokens``;
* prefill chunks -- translated once into vLLM's chunking knobs (policies.py).

Events reach every policy with the same views and at the same points as in
cbcore's engine: ``on_arrival`` (add_request), ``on_step_end`` (with the
preempted) then ``on_finish`` (update_from_output), ``on_finish`` on abort
(finish_requests).
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from typing import Any

import structlog
import vllm
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request

from cbcore_vllm._cbcore import ConfigError, LazyViews, PolicyError, SchedulerState, StepResult
from cbcore_vllm.config import TESTED_VLLM, StepClock, parse
from cbcore_vllm.policies import build, chunking, refuse_unsupported
from cbcore_vllm.queue import PolicyRequestQueue
from cbcore_vllm.refusal import Refusals
from cbcore_vllm.running import VictimList
from cbcore_vllm.views import KVCacheView, RequestFieldError, RequestView

log = structlog.get_logger(__name__)


class Scheduler(VllmScheduler):
    """vLLM's scheduler, with order, victims and limits from a cbcore ``scheduler:`` config."""

    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        config, adapter = parse(vllm_config.additional_config)  # before any work: a bad config fails first
        if vllm.__version__ != TESTED_VLLM and not adapter.allow_untested_vllm:
            raise ConfigError(
                f"cbcore_vllm was tested against vLLM {TESTED_VLLM}, this is {vllm.__version__}: its scheduler "
                "internals may differ; set additional_config.cbcore.allow_untested_vllm: true to try anyway"
            )
        sc = vllm_config.scheduler_config
        if sc.async_scheduling:
            raise ConfigError(
                "cbcore_vllm.Scheduler needs --no-async-scheduling: policies see each step's results "
                "(on_step_end) before the next step is planned, as in cbcore's engine"
            )
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

        self.policy = SchedulingPolicy.FCFS  # vLLM's victim path that reads running[-1] (see running.py)
        self.waiting = PolicyRequestQueue(self._order_requests)
        self.kv_holding_waiting = PolicyRequestQueue(self._order_requests)
        self._clock_step_s = adapter.clock.step_s if isinstance(adapter.clock, StepClock) else None
        self._step = 0
        self._now = self._read_clock()
        self._views: dict[str, RequestView] = {}
        self._preempted: list[RequestView] = []  # this step's, for on_step_end
        self._kv_view = KVCacheView(self.kv_cache_manager, self.block_size)
        self._vllm_max_tokens = self.max_num_scheduled_tokens
        self._vllm_max_seqs = self.max_num_active_reqs
        self._refusals = Refusals()
        self._clamp_noted = False
        self._finished_in_update: list[RequestView] | None = None
        self._wrap_allocate_slots()
        log.info(
            "cbcore policies decide in vLLM's scheduler",
            policies=[self._policies.names[id(p)] for p in self._policies.policies],
            chunked_prefill=chunks.enable_chunked_prefill,
            long_prefill_token_threshold=chunks.long_prefill_token_threshold,
            clock="wall" if self._clock_step_s is None else f"{self._clock_step_s} s per step",
        )

    # -- time and ordering ---------------------------------------------------

    def _read_clock(self) -> float:
        return time.monotonic() if self._clock_step_s is None else self._step * self._clock_step_s

    def _order_requests(self, requests: list[Request]) -> list[Request]:
        views = [self._views[r.request_id] for r in requests]
        return [v.request for v in self._policies.order(views, self._now)]

    def _admits(self, request: Request) -> bool:
        return self._policies.may_admit(self._views[request.request_id], self._state)

    def _choose_victim(self, candidates: list[Request]) -> Request:
        views = [self._views[r.request_id] for r in candidates]
        return self._policies.victim(views, self._now).request

    def _wrap_allocate_slots(self) -> None:
        """Note which request asks for blocks: the running loop's victim candidates start there."""
        allocate = self.kv_cache_manager.allocate_slots

        def allocate_slots(request: Request, *args: Any, **kwargs: Any) -> Any:
            if isinstance(self.running, VictimList):
                self.running.asking = request
            return allocate(request, *args, **kwargs)

        self.kv_cache_manager.allocate_slots = allocate_slots  # type: ignore[method-assign]

    # -- one step ------------------------------------------------------------

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        self._step += 1
        self._now = self._read_clock()
        views = self._views
        self._state = SchedulerState(
            now=self._now,
            step=self._step,
            waiting=LazyViews(lambda: [views[r.request_id] for r in self.waiting.ordered()]),
            running=tuple(views[r.request_id] for r in self.running),
            swapped=(),
            kv=self._kv_view,
        )
        budget = self._policies.budget
        limits = self._policies.limits(self._state)
        if not self._clamp_noted and (
            limits.max_num_tokens > self._vllm_max_tokens or limits.max_num_seqs > self._vllm_max_seqs
        ):
            self._clamp_noted = True
            log.warning(
                "the budget's limits exceed vLLM's; vLLM's apply (its model runner is sized by them)",
                budget=self._policies.names[id(budget)],
                budget_limits=(limits.max_num_seqs, limits.max_num_tokens),
                vllm_limits=(self._vllm_max_seqs, self._vllm_max_tokens),
            )
        self.max_num_scheduled_tokens = min(self._vllm_max_tokens, limits.max_num_tokens)
        self.max_num_active_reqs = min(self._vllm_max_seqs, limits.max_num_seqs)
        in_order = self._order_requests(list(self.running))
        decodes = [r for r in in_order if not views[r.request_id].is_prefilling]
        prefills = [r for r in in_order if views[r.request_id].is_prefilling]
        self.running = VictimList(decodes + prefills, self._choose_victim)
        was_waiting = set(self.waiting) | set(self.kv_holding_waiting)
        self.waiting.begin_step(self._admits)
        self.kv_holding_waiting.begin_step(self._admits)
        try:
            out = super().schedule(throttle_prefills)
        finally:
            self.waiting.end_step()
            self.kv_holding_waiting.end_step()
            if isinstance(self.running, VictimList):
                self.running.settle()
        for rid, n in out.num_scheduled_tokens.items():
            request = self.requests[rid]
            if request in was_waiting:  # admitted: what its cache lookup found is now behind num_computed
                views[rid].num_cached_prompt_tokens = request.num_computed_tokens - n
        return out

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        scheduled = scheduler_output.num_scheduled_tokens
        before = {rid: self.requests[rid].num_output_tokens for rid in scheduled if rid in self.requests}
        self._refusals.hand_to(self)
        self._finished_in_update = []
        try:
            outputs = super().update_from_output(scheduler_output, model_runner_output)
            finished, self._finished_in_update = self._finished_in_update, None
        finally:
            self._finished_in_update = None
        results: list[StepResult] = []
        for rid, n in scheduled.items():
            view = self._views.get(rid) or next((v for v in finished if v.request_id == rid), None)
            if view is None:
                continue
            grew = view.request.num_output_tokens > before.get(rid, view.request.num_output_tokens)
            results.append(StepResult(seq=view, num_computed=n, new_token=view.request.output_token_ids[-1] if grew else None))
        results += [StepResult(seq=view, num_computed=0, new_token=None, preempted=True) for view in self._preempted]
        self._preempted = []
        failures = self._policies.step_ended(results, self._now)
        for view in finished:
            self._tell_finish(view)
        if failures:  # vLLM cannot end one request from here: its engine stops, naming the plugin
            raise failures[0]
        return outputs

    # -- events --------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:  # a streaming session's next chunk: not a new arrival
            super().add_request(request)
            return
        now = self._read_clock()
        try:
            view = RequestView(request, now, self.kv_cache_manager)
        except RequestFieldError as exc:
            self._refusals.refuse(self, request, str(exc))
            return
        try:  # as in cbcore: if a policy raises, the request is not added and those told see it finish
            if self._policies.fixed_keys:
                view.queue_key = self._policies.key(view, now)
            self._policies.arrived(view, now)
        except PolicyError as exc:
            self._refusals.refuse(self, request, str(exc))
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
                self._finished_in_update.append(view)
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
