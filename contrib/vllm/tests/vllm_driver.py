"""Run traces through vLLM's offline engine with cbcore_vllm.Scheduler (run with .venv-vllm's python).

    python vllm_driver.py SPEC.json OUT.json

SPEC: {"scenarios": [{"name", "model", "engine": {...EngineArgs...}, "cbcore": {...},
"requests": [{"id", "prompt", "max_tokens", "priority", "xargs", "arrive"}]}]}. Each scenario
gets its own engine, in process (VLLM_ENABLE_V1_MULTIPROCESSING=0), stepped one schedule() at a time:
requests with ``arrive == k`` are added before step k. OUT records per scenario the start-up time,
the ids in the order vLLM first scheduled them, the preemptions, each request's tokens, or the error.
"""

from __future__ import annotations

import gc
import json
import sys
import time
import traceback
from typing import Any


def external(request_id: str) -> str:
    """The caller's id: vLLM's engine appends '-<8 hex digits>' to keep ids unique."""
    return request_id.rsplit("-", 1)[0]


def run(scn: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.llm_engine import LLMEngine

    t0 = time.monotonic()
    engine_args = {
        "enforce_eager": True,
        "dtype": "float32",
        "block_size": 32,
        "async_scheduling": False,
        "seed": 0,
        **scn["engine"],
    }
    args = EngineArgs(
        model=scn["model"],
        scheduler_cls="cbcore_vllm.Scheduler",
        additional_config={"cbcore": scn["cbcore"]},
        **engine_args,
    )
    try:
        engine = LLMEngine.from_engine_args(args)
    except Exception as exc:
        return {"name": scn["name"], "error": f"{type(exc).__name__}: {exc}", "startup_s": time.monotonic() - t0}
    startup = time.monotonic() - t0
    sched = engine.engine_core.engine_core.scheduler
    first: list[str] = []
    preempted: list[list[Any]] = []
    scheduled: list[dict[str, int]] = []  # per step: tokens scheduled per request
    steps = [0]
    schedule, preempt = sched.schedule, sched._preempt_request

    def recording_schedule(*a: Any, **k: Any) -> Any:
        steps[0] += 1
        out = schedule(*a, **k)
        first.extend(ext for r in out.scheduled_new_reqs if (ext := external(r.req_id)) not in first)
        scheduled.append({external(rid): n for rid, n in out.num_scheduled_tokens.items()})
        return out

    def recording_preempt(request: Any, *a: Any, **k: Any) -> None:
        preempted.append([steps[0], external(request.request_id)])
        preempt(request, *a, **k)

    sched.schedule, sched._preempt_request = recording_schedule, recording_preempt
    pending = sorted(scn["requests"], key=lambda r: r.get("arrive", 0))
    tokens: dict[str, list[int]] = {}
    finish: dict[str, str | None] = {}
    error = None
    t1 = time.monotonic()
    try:
        for k in range(5000):
            while pending and pending[0].get("arrive", 0) <= k:
                r = pending.pop(0)
                params = SamplingParams(
                    max_tokens=r["max_tokens"],
                    temperature=0.0,
                    ignore_eos=r.get("ignore_eos", True),
                    extra_args=r.get("xargs"),
                    detokenize=False,
                )
                engine.add_request(
                    r["id"], TokensPrompt(prompt_token_ids=r["prompt"]), params, priority=r.get("priority", 0)
                )
            for out in engine.step():
                if out.finished:
                    tokens[out.request_id] = list(out.outputs[0].token_ids)
                    finish[out.request_id] = out.outputs[0].finish_reason
            if not pending and not engine.has_unfinished_requests():
                break
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    result = {
        "name": scn["name"],
        "startup_s": startup,
        "run_s": time.monotonic() - t1,
        "steps": steps[0],
        "first_scheduled": first,
        "preempted": preempted,
        "scheduled": scheduled,
        "tokens": tokens,
        "finish": finish,
        "error": error,
    }
    del engine, sched
    gc.collect()
    return result


def main() -> int:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    results = [run(s) for s in spec["scenarios"]]
    with open(sys.argv[2], "w") as f:
        json.dump({"results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
