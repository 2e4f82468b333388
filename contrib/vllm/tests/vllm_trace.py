"""One deterministic multi-tenant trace and the cbcore-engine side of every comparison."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

STEP_S = 0.1  # both engines' policy clock: 0.1 s per scheduler step

# id, prompt tokens, max tokens, priority, client, deadline_s, arrival step
ROWS = [
    ("A", 20, 8, 2, "c1", 4.0, 0),
    ("B", 12, 3, 1, "c1", 0.4, 0),
    ("C", 28, 5, 0, "c2", 2.0, 0),
    ("D", 8, 6, 2, "c2", 0.2, 0),
    ("E", 16, 4, 0, "c1", 3.0, 2),
    ("F", 24, 2, 1, "c3", 1.0, 3),
    ("G", 10, 7, 1, "c3", 0.5, 6),
    ("H", 14, 3, 0, "c2", 6.0, 8),
]


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [1, 10 + seed, *(rng.randrange(3, 500) for _ in range(n - 2))]  # distinct second token: no shared prefix


def trace(rows: list[tuple[Any, ...]] = ROWS) -> list[dict[str, Any]]:
    return [
        {
            "id": rid,
            "prompt": prompt(i, n),
            "max_tokens": out,
            "priority": prio,
            "xargs": {"client_id": client, "deadline_s": deadline},
            "arrive": arrive,
        }
        for i, (rid, n, out, prio, client, deadline, arrive) in enumerate(rows)
    ]


def run_cbcore(model_dir: Path, config: dict[str, Any], requests: list[dict[str, Any]]) -> dict[str, Any]:
    """The same trace through cbcore's engine, stepped the way the driver steps vLLM."""
    import torch
    from transformers import AutoModelForCausalLM

    from cbcore import Engine, EngineConfig, SamplingParams

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ticks = [0]
    engine = Engine(model, None, EngineConfig.model_validate(config), clock=lambda: ticks[0] * STEP_S)
    first: list[str] = []
    preempted: list[list[Any]] = []
    scheduled: list[dict[str, int]] = []

    def listen(record: Any) -> None:
        for item in record.output.scheduled:
            if item.seq.request_id not in first:
                first.append(item.seq.request_id)
        preempted.extend([ticks[0], s.request_id] for s in record.output.preempted)
        scheduled.append({item.seq.request_id: item.num_tokens for item in record.output.scheduled})

    engine.step_listeners.append(listen)
    pending = sorted(requests, key=lambda r: r.get("arrive", 0))
    tokens: dict[str, list[int]] = {}
    for k in range(5000):
        while pending and pending[0].get("arrive", 0) <= k:
            r = pending.pop(0)
            xargs = r.get("xargs") or {}
            engine.add_request(
                r["prompt"],
                SamplingParams(max_new_tokens=r["max_tokens"], ignore_eos=True),
                request_id=r["id"],
                priority=r.get("priority", 0),
                client_id=xargs.get("client_id", "default"),
                deadline_s=xargs.get("deadline_s"),
            )
        ticks[0] += 1
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.output_token_ids)
        if not pending and not engine.has_unfinished():
            break
    return {"first_scheduled": first, "preempted": preempted, "scheduled": scheduled, "tokens": tokens}
