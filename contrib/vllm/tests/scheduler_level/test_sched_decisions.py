"""The policies decide inside vLLM's real scheduler of this version, synchronous and async.

Driven as vLLM's engine core drives it (cbcore_vllm.harness), with fake model
outputs; each test states what must hold on every tested version, and where
versions differ, which version does what.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sched_level import PLUGIN, SELF_VICTIM_ENDS_LOOP, drive, events
from vllm_trace import VICTIM_RULES, admission_requests, preemption_requests, victim_config

STEP_S = 0.1


def recorder(log: Path) -> dict:
    return {
        "plugins": [PLUGIN],
        "scheduler": {
            "queue": {"name": "longest-prompt-first", "log": str(log)},
            "budget": {"name": "token-budget", "max_num_seqs": 1, "max_num_batched_tokens": 64},
        },
        "clock": {"step_s": STEP_S},
    }


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_file_plugin_queue_decides_admission_order(tmp_path: Path, mode: str) -> None:
    log = tmp_path / "events.jsonl"
    driver, decisions = drive(recorder(log), admission_requests(), max_num_seqs=1, max_num_batched_tokens=64,
                              async_scheduling=mode == "async")  # fmt: skip
    # Arrival order X, A, B, C; one running slot; the plugin serves the longest prompt first.
    assert [rid for _, rid in decisions.first_scheduled()] == ["X", "C", "B", "A"]
    assert {rid: o.finish_reason.name for rid, o in driver.finished().items()} == dict.fromkeys("XABC", "LENGTH")
    assert [e["id"] for e in events(log) if e["event"] == "finish"] == ["X", "C", "B", "A"]


def test_async_event_timing(tmp_path: Path) -> None:
    """docs/vllm.md, "Async scheduling": on_step_end for step N arrives after step N+1 was planned."""
    runs = {}
    for mode in ("sync", "async"):
        log = tmp_path / f"{mode}.jsonl"
        driver, decisions = drive(recorder(log), admission_requests(), max_num_seqs=1, max_num_batched_tokens=64,
                                  async_scheduling=mode == "async")  # fmt: skip
        runs[mode] = driver.calls, events(log), decisions
    sync_calls, sync_events, sync_steps = runs["sync"]
    async_calls, async_events, async_steps = runs["async"]
    # vLLM's call order: synchronous, each step's update follows its schedule; async, the next schedule comes first.
    assert sync_calls[:4] == [("schedule", 1), ("update", 1), ("schedule", 2), ("update", 2)]
    assert async_calls[:5] == [("schedule", 1), ("schedule", 2), ("update", 1), ("schedule", 3), ("update", 2)]

    # The step clock advances with each planned step, so `now` says when an event was delivered.
    def delivered(evs: list[dict], rid: str) -> list[tuple[str, float]]:
        return [(e["event"], round(e["now"], 6)) for e in evs
                if (e["event"] == "step_end" and any(r[0] == rid for r in e["rows"])) or (e.get("id") == rid
                and e["event"] == "finish")]  # fmt: skip

    # X: prefill in step 1, its 2nd and 3rd tokens in steps 2 and 3, then it finishes.
    assert delivered(sync_events, "X") == [("step_end", 0.1), ("step_end", 0.2), ("step_end", 0.3), ("finish", 0.3)]
    assert delivered(async_events, "X") == [("step_end", 0.2), ("step_end", 0.3), ("step_end", 0.4), ("finish", 0.4)]
    # Async, step 4 was planned before step 3's result freed X's slot: C is admitted a step later (step 5).
    assert next(s.k for s in sync_steps.steps if "C" in s.scheduled) == 3
    assert next(s.k for s in async_steps.steps if "C" in s.scheduled) == 4
    assert [rid for _, rid in async_steps.first_scheduled()] == [rid for _, rid in sync_steps.first_scheduled()]


@pytest.mark.parametrize("rule", VICTIM_RULES)
def test_victims_and_what_follows_a_self_preemption(rule: str) -> None:
    config = victim_config(rule) | {"clock": {"step_s": STEP_S}}
    _, decisions = drive(config, preemption_requests(), max_num_seqs=3, max_num_batched_tokens=128, num_blocks=4,
                         max_model_len=128)  # fmt: skip
    victims = [rid for _, rid in decisions.victims()]
    # P1 has the lowest priority (the largest value); P3 is the newest and the least advanced.
    assert victims[:2] == (["P1", "P3"] if rule == "lowest-priority" else ["P3", "P1"])
    if rule == "lowest-priority":
        return
    step = next(s for s in decisions.steps if s.preempted)
    assert step.preempted[0] == step.askers[0] == "P3"  # P3 asked for a block and was its own victim
    # What follows differs by version: 0.32.0's fcfs path ends the running loop (P1, after P3, waits a step);
    # from 0.33.0 the adapter takes vLLM's priority path, which goes on with P1, as cbcore's engine does.
    assert step.scheduled == ({"P2": 1} if SELF_VICTIM_ENDS_LOOP else {"P2": 1, "P1": 1})


def test_preemption_plugin_chooses_among_the_candidates(tmp_path: Path) -> None:
    log = tmp_path / "victims.jsonl"
    config = {
        "plugins": [PLUGIN],
        "scheduler": {
            "queue": {"name": "longest-prompt-first"},
            "budget": {"name": "token-budget", "max_num_seqs": 3, "max_num_batched_tokens": 128},
            "preemption": {"name": "evict-longest-prompt", "log": str(log)},
        },
    }
    _, decisions = drive(config, preemption_requests(), max_num_seqs=3, max_num_batched_tokens=128, num_blocks=4,
                         max_model_len=128)  # fmt: skip
    asked = [e for e in events(log) if e["event"] == "victim"]
    assert asked, "the tight cache must force a choice"
    # vLLM's own rule would evict the last candidate (P2, the shortest prompt here); the plugin takes P3.
    assert asked[0]["id"] == "P3" and asked[0]["candidates"][-1] == "P2"
    assert [rid for _, rid in decisions.victims()][: len(asked)] == [e["id"] for e in asked]
