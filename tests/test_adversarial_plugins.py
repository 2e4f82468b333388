"""Property: whatever a plugin does, the engine neither lies, hangs nor loses work.

Hypothesis draws a workload (prompts, caps, aborts at random steps) and a
fault (recompute with prefix caching, or swap): a policy of the composed
scheduler, or a whole-scheduler plugin, that at
one step duplicates, drops, overruns a budget, returns a wrong type, skips its
KV blocks or raises from one of its methods. After every step, either the step
ran and every finished output is token-exact against the per-prompt
reference, or a ``SchedulerError`` (or ``SchedulerStall``) naming the faulty
plugin came out; then the block bookkeeping checks clean and, once everything
is aborted, no block is held. Each example is bounded in steps.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from support import PROMPTS
from support.adversarial_plugins import Faults

from cbcore import Engine, EngineConfig, SamplingParams, SchedulerError
from cbcore.testing import assert_equivalent, compare_greedy, reference_generate, tiny_model
from cbcore.testing.block_invariants import check_blocks

HERE = str(Path(__file__).parent / "support" / "adversarial_plugins.py")
MAX_STEPS = 150
POOL = [PROMPTS[i][:12] for i in range(8)]  # prompts of up to 12 tokens


COMPOSED = {
    "order": ("queue", "faulty-queue", ["duplicate", "drop", "wrong_type", "raise"]),
    "on_arrival": ("queue", "faulty-queue", ["raise"]),
    "on_step_end": ("queue", "faulty-queue", ["raise"]),
    "on_finish": ("queue", "faulty-queue", ["raise"]),
    "limits": ("budget", "faulty-budget", ["zero", "wrong_type", "raise"]),
    "may_admit": ("budget", "faulty-budget", ["raise"]),
    "num_tokens": ("prefill", "faulty-prefill", ["overrun", "negative", "float", "raise"]),
    "choose_victim": ("preemption", "faulty-preemption", ["stranger", "raise"]),
}
WHOLE = ["twice", "overrun", "no_blocks", "finished", "empty", "raise", "wrong_type"]


@functools.cache
def model():
    return tiny_model("llama")


@functools.cache
def reference(prompt: int, cap: int):
    return reference_generate(model(), [POOL[prompt]], [cap])[0]


requests = st.lists(
    st.tuples(st.integers(0, len(POOL) - 1), st.integers(1, 8), st.one_of(st.none(), st.integers(0, 15))),
    min_size=1,
    max_size=6,
)


def build(target: str, swap: bool) -> Engine:
    kv = {"block_size": 4, "num_blocks": 12, "prefix_caching": not swap}
    if target == "schedule":
        scheduler = {"name": f"{HERE}:FaultyFifo"}
        kv = {"block_size": 4, "num_blocks": 32}
    else:
        scheduler = {
            "queue": {"name": f"{HERE}:FaultyQueue"},
            "budget": {"name": f"{HERE}:FaultyBudget", "max_num_seqs": 4, "max_num_batched_tokens": 16},
            "prefill": {"name": f"{HERE}:FaultyPrefill", "chunk_size": 8},
            "preemption": {"name": f"{HERE}:FaultyPreemption"},
        }
        if swap:
            scheduler["preemption"]["name"] = f"{HERE}:FaultySwap"
    config = EngineConfig.model_validate({"backend": {"name": "eager"}, "kv_cache": kv, "scheduler": scheduler})
    return Engine(model(), config=config)


def live_seqs(engine: Engine) -> list:
    sched = engine.scheduler
    return list(getattr(sched, "running", []))  # the sequences holding device blocks


def culprit_of(target: str, swap: bool) -> str:
    if target == "schedule":
        return "faulty-fifo"
    if target == "choose_victim" and swap:
        return "faulty-swap"
    return COMPOSED[target][1]


# Events that fail after the step's forward and commit (its KV written, its full blocks registered as
# cached prefixes): the undo's hardest case, drawn more often and at later steps. An undo that keeps the
# failed step's prefix registrations was first caught, over 20 random seeds, after 6-199 examples (median 35)
# with on_step_end and 6-98 with on_finish, by one of the two within 60 in every seed (with faults at steps
# 0-4 only: 34-300+, median 100, for on_step_end). 90 examples each cost about 10 s on a 2-core machine.
AFTER_COMMIT = [("on_step_end", "raise"), ("on_finish", "raise")]
FAULTS = [(t, k) for t, (_, _, kinds) in COMPOSED.items() for k in kinds if (t, k) not in AFTER_COMMIT]
FAULTS += [("schedule", k) for k in WHOLE]
SETTINGS = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow], "derandomize": True}


@pytest.mark.parametrize(("target", "kind"), FAULTS, ids=[f"{t}-{k}" for t, k in FAULTS])
@settings(max_examples=4, **SETTINGS)
@given(at=st.integers(0, 4), reqs=requests, swap=st.booleans())
def test_no_plugin_makes_the_engine_lie_hang_or_leak(target, kind, at, reqs, swap) -> None:
    check(target, kind, at, reqs, swap)


@pytest.mark.parametrize(("target", "kind"), AFTER_COMMIT, ids=[f"{t}-{k}" for t, k in AFTER_COMMIT])
@settings(max_examples=90, **SETTINGS)
@given(at=st.integers(0, 12), reqs=requests, swap=st.booleans())
def test_an_event_failing_after_the_commit_makes_the_engine_neither_lie_hang_nor_leak(target, kind, at, reqs, swap):
    check(target, kind, at, reqs, swap)


def check(target: str, kind: str, at: int, reqs: list, swap: bool) -> None:
    """One workload with one fault: every step's books balance, outputs are exact, an error names its plugin."""
    engine = build(target, swap)
    plan = Faults(target, at, kind)
    door = getattr(engine.scheduler, "door", None)
    for plugin in door.policies if door is not None else (engine.scheduler.plugin,):
        plugin.faults = plan
    which: dict[str, tuple[int, int]] = {}
    aborts: dict[int, list[str]] = {}
    finished = {}
    error = None
    try:
        for i, (prompt, cap, abort_at) in enumerate(reqs):
            rid = engine.add_request(list(POOL[prompt]), SamplingParams(max_new_tokens=cap), request_id=f"r{i}")
            which[rid] = (prompt, cap)
            if abort_at is not None:
                aborts.setdefault(abort_at, []).append(rid)
        steps = 0
        while engine.has_unfinished():
            assert steps < MAX_STEPS, f"no end after {MAX_STEPS} steps"
            plan.step = steps
            for rid in aborts.get(steps, []):
                if engine.abort(rid):
                    which.pop(rid)
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
            check_blocks(engine.scheduler.blocks, live_seqs(engine))
            steps += 1
    except SchedulerError as exc:
        error = exc
    event(f"{target}/{kind}: {'error' if error else 'fired, ran on' if plan.fired else 'not reached'}")
    if error is not None:
        assert plan.fired, f"an error without a fault: {error}"
        assert culprit_of(target, swap) in str(error), error
        check_blocks(engine.scheduler.blocks, live_seqs(engine))
    # A request ended with an error was the one the fault concerned, and its error names the culprit.
    named = [o for o in finished.values() if o.finish_reason == "error"]
    assert len(named) <= 1 and (not named or plan.fired), [o.error for o in named]
    assert all(culprit_of(target, swap) in o.error for o in named), [o.error for o in named]
    # Every other request that finished is token-exact against its prompt run alone.
    done = [o for rid, o in finished.items() if rid in which and o.finish_reason not in ("abort", "error")]
    assert all(o.finish_reason in ("stop", "length") for o in done), [o.error for o in done]
    refs = [reference(*which[o.request_id]) for o in done]
    if done:
        assert_equivalent(compare_greedy(model(), done, refs))
    plan.enabled = False
    for rid in list(engine._live):
        engine.abort(rid)
    assert not engine.has_unfinished()
    blocks = engine.scheduler.blocks
    check_blocks(blocks, [])
    assert blocks.num_free_blocks == blocks.num_blocks
