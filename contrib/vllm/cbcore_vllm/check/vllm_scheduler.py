"""A workload through vLLM's scheduler alone (``cbcore_vllm.harness``), synchronous, with fake model outputs."""

from __future__ import annotations

from typing import Any

from cbcore_vllm.check.setup import Setup
from cbcore_vllm.check.trace import Trace, Tracer


def run_vllm_scheduler(setup: Setup) -> tuple[Trace, str]:
    import vllm

    import cbcore_vllm.harness as harness  # first of vLLM: it sets the platform

    trace = Trace(engine=f"vLLM {vllm.__version__} (scheduler, synchronous)")
    try:
        scheduler = harness.build_scheduler(
            setup.adapter_config(),
            max_num_seqs=setup.max_num_seqs,
            max_num_batched_tokens=setup.max_num_batched_tokens,
            num_blocks=setup.num_blocks,
            block_size=setup.block_size,
            max_model_len=setup.max_model_len,
        )
    except Exception as exc:  # a config vLLM or the adapter refuses: the result, not a crash
        trace.error = f"{type(exc).__name__}: {exc}"
        return trace, vllm.__version__
    scheduler.tracer = tracer = Tracer()
    trace.chunk_threshold = scheduler.scheduler_config.long_prefill_token_threshold
    driver = harness.Driver(scheduler)
    try:
        driver.run(setup.requests, before_step=lambda k: setattr(tracer, "k", k))
    except Exception as exc:
        trace.error = f"{type(exc).__name__}: {exc}"
    record(trace, driver, tracer)
    return trace, vllm.__version__


def record(trace: Trace, driver: Any, tracer: Tracer) -> Trace:
    """Fill ``trace`` from a finished harness run: the tracer's steps, each request's end and token count."""
    trace.steps = tracer.steps
    for out in driver.outputs:
        trace.output_lengths[out.request_id] = trace.output_lengths.get(out.request_id, 0) + len(out.new_token_ids)
        if out.finish_reason is not None:
            trace.finish[out.request_id] = out.finish_reason.name.lower()
    return trace
