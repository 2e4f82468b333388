"""A workload through cbcore's own engine, stepped the way the vLLM side is stepped.

Requests with ``arrive == k`` are added before driver iteration ``k``; an
iteration with nothing to serve plans nothing and does not advance the step
clock (vLLM's engine does not call its scheduler then either), so both
engines' policies read the same ``now``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cbcore_vllm._cbcore import Engine, EngineConfig, SamplingParams
from cbcore_vllm.check.trace import StepTrace, Trace

MAX_ITERATIONS = 100_000


def attrs_of(xargs: dict[str, Any]) -> dict[str, Any] | None:
    """``attrs`` as a mapping (over HTTP it travels as JSON text in ``vllm_xargs``)."""
    attrs = xargs.get("attrs")
    return json.loads(attrs) if isinstance(attrs, str) else attrs


def run_cbcore(model_dir: Path, config: dict[str, Any], requests: list[dict[str, Any]], step_s: float) -> Trace:
    """``config``: a cbcore config (``plugins``, ``scheduler``, ``kv_cache``); ``requests`` as the driver takes them."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ticks = [0]
    engine = Engine(model, None, EngineConfig.model_validate(config), clock=lambda: ticks[0] * step_s)
    trace = Trace(engine="cbcore")
    k = [0]

    def listen(record: Any) -> None:
        step = StepTrace(k=k[0], scheduled={it.seq.request_id: it.num_tokens for it in record.output.scheduled})
        step.preempted = [s.request_id for s in record.output.preempted]
        if step.scheduled or step.preempted:
            trace.steps.append(step)

    engine.step_listeners.append(listen)
    pending = sorted(requests, key=lambda r: r.get("arrive", 0))
    try:
        for k[0] in range(MAX_ITERATIONS):
            while pending and pending[0].get("arrive", 0) <= k[0]:
                r = pending.pop(0)
                xargs = r.get("xargs") or {}
                engine.add_request(
                    r["prompt"],
                    SamplingParams(max_new_tokens=r["max_tokens"], ignore_eos=True),
                    request_id=r["id"],
                    priority=r.get("priority", 0),
                    client_id=xargs.get("client_id", "default"),
                    deadline_s=xargs.get("deadline_s"),
                    attrs=attrs_of(xargs),
                )
            if engine.has_unfinished():
                ticks[0] += 1
                for out in engine.step():
                    if out.finished:
                        trace.output_lengths[out.request_id] = len(out.output_token_ids)
                        trace.finish[out.request_id] = out.finish_reason
            elif not pending:
                break
    except Exception as exc:  # a plugin's error, named by cbcore: part of the result, not a crash of the check
        trace.error = f"{type(exc).__name__}: {exc}"
    return trace
