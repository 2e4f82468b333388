"""One deterministic multi-tenant trace, and the cbcore-engine side of every comparison (cbcore_vllm.check's)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from cbcore_vllm.check.cbcore_side import run_cbcore as cbcore_trace
from cbcore_vllm.check.trace import Trace

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


# Policies whose first-scheduled order on this trace must be cbcore's (with LIMITS, a roomy cache).
EQUIVALENCE: dict[str, dict[str, Any]] = {
    "fcfs": {"queue": {"name": "fcfs"}},
    "priority-aging": {"queue": {"name": "priority", "aging_s": 0.5, "preempt_running": False}},
    "vtc": {"queue": {"name": "vtc"}},
    "sjf": {"queue": {"name": "sjf", "aging_s": 0.5}},
    "edf": {"queue": {"name": "edf"}},  # contrib edf (cbcore-edf), installed in both venvs
    # static's waves reach vLLM through may_admit (the queue hides the requests it refuses)
    "fcfs-static": {"queue": {"name": "fcfs"}, "budget": {"name": "static", "max_num_seqs": 2, "max_num_batched_tokens": 64}},
}
LIMITS = {"name": "token-budget", "max_num_seqs": 2, "max_num_batched_tokens": 64}


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


def admission_requests() -> list[dict[str, Any]]:
    # X holds the only slot; A, B, C arrive together, shortest prompt first.
    return [
        {"id": "X", "prompt": [1, 7, 7, 7], "max_tokens": 3, "arrive": 0},
        {"id": "A", "prompt": [1, 8, 9], "max_tokens": 2, "arrive": 1},
        {"id": "B", "prompt": [1, 11, 12, 13, 14], "max_tokens": 2, "arrive": 1},
        {"id": "C", "prompt": [1, 21, 22, 23, 24, 25, 26, 27], "max_tokens": 2, "arrive": 1},
    ]


def preemption_requests() -> list[dict[str, Any]]:
    rows = [("P1", 30, 40, 2, "c", 9.0, 0), ("P2", 20, 40, 0, "c", 9.0, 0), ("P3", 26, 40, 1, "c", 9.0, 0)]
    return trace(rows)


VICTIM_RULES = ("newest", "lowest-priority", "least-progress")


def victim_config(rule: str) -> dict[str, Any]:
    return {
        "scheduler": {
            "queue": {"name": "priority", "preempt_running": False},
            "budget": {"name": "token-budget", "max_num_seqs": 3, "max_num_batched_tokens": 128},
            "preemption": {"name": "recompute", "victim": rule},
        }
    }


def run_cbcore(model_dir: Path, config: dict[str, Any], requests: list[dict[str, Any]]) -> Trace:
    """The same trace through cbcore's engine, stepped as the vLLM side is (the decision check's own runner)."""
    return cbcore_trace(model_dir, config, requests, STEP_S)
