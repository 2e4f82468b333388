"""The adapter inside vLLM's offline engine, checked against cbcore's engine on the same traces.

All scenarios run in one vLLM driver process (one engine each, on a tiny random
Llama); each test reads its scenario's result. Both engines get the same
limits, the same KV geometry and the same step clock (trace.STEP_S per step),
so time-dependent policies (aging, deadlines) decide the same way.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from cbcore_vllm.check.compare import compare
from cbcore_vllm.check.differences import applicable, load
from cbcore_vllm.check.trace import Trace
from vllm_helpers import PLUGIN, STARTED_EARLY, Started, driver_results
from vllm_trace import (
    EQUIVALENCE,
    LIMITS,
    VICTIM_RULES,
    admission_requests,
    preemption_requests,
    run_cbcore,
    trace,
    victim_config,
)

# Every test here starts vLLM (from .venv-vllm, `make vllm-setup`); they run in CI.
pytestmark = pytest.mark.vllm

BLOCK = 32
ROOMY = {"num_gpu_blocks_override": 201}  # vLLM keeps one null block: 200 usable, as cbcore's num_blocks
TIGHT_BLOCKS = 4



def engine(max_num_seqs: int, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "skip_tokenizer_init": True,
        "max_model_len": 256,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_tokens,
        **ROOMY,
        **extra,
    }


# A config vLLM cannot start with, and what its error must say (cbcore's words: key path, suggestion).
CONFIG_ERRORS: dict[str, tuple[dict[str, Any], str]] = {
    "bad-param": (
        {"scheduler": {"queue": {"name": "priority", "agin": 1}}},
        "additional_config.cbcore: scheduler.queue.agin: Extra inputs are not permitted (did you mean 'aging_s'?)",
    ),
    "kv-cache-section": (
        {"kv_cache": {"num_blocks": 8}},
        "additional_config.cbcore.kv_cache: inside vLLM this is decided by --block-size",
    ),
    "prefill-first": (
        {"plugins": [PLUGIN], "scheduler": {"prefill": {"name": "whole-prompt"}, "order": "prefill-first"}},
        "scheduler.order 'prefill-first' cannot be honoured",
    ),
}

CHUNK8 = {"name": "chunked-prefill", "chunk_size": 8}


def chunk_requests() -> list[dict[str, Any]]:
    # L alone, then M and N together, long after L has finished.
    return trace([("L", 30, 2, 0, "c", 9.0, 0), ("M", 20, 2, 0, "c", 9.0, 10), ("N", 20, 2, 0, "c", 9.0, 10)])


def refused_requests() -> list[dict[str, Any]]:
    # A's deadline and B's attrs are what cbcore's add_request refuses; X and C must be served regardless.
    reqs = admission_requests()
    reqs[1]["xargs"] = {"deadline_s": -1}
    reqs[2]["xargs"] = {"attrs": "{not json"}
    return reqs


def scenarios(model: Path, log_dir: Path) -> list[dict[str, Any]]:
    clock = {"step_s": 0.1}
    out = [
        {
            "name": "admission",
            "model": str(model),
            "engine": engine(1, 64),
            "cbcore": {
                "plugins": [PLUGIN],
                "scheduler": {
                    "queue": {"name": "longest-prompt-first", "log": str(log_dir / "admission.jsonl")},
                    "budget": {"name": "token-budget", "max_num_seqs": 1, "max_num_batched_tokens": 64},
                },
                "clock": clock,
            },
            "requests": admission_requests(),
        },
        {
            "name": "preemption",
            "model": str(model),
            "engine": engine(3, 128, num_gpu_blocks_override=TIGHT_BLOCKS + 1, max_model_len=TIGHT_BLOCKS * BLOCK),
            "cbcore": preemption_config(log_dir / "victims.jsonl") | {"clock": clock},
            "requests": preemption_requests(),
        },
        {
            "name": "garbage-order",
            "model": str(model),
            "engine": engine(1, 64),
            "cbcore": {"plugins": [PLUGIN], "scheduler": {"queue": {"name": "garbage-order"}}},
            "requests": admission_requests(),
        },
        {
            "name": "refusals",
            "model": str(model),
            "engine": engine(1, 64),
            "cbcore": {"scheduler": {"budget": {"name": "token-budget", "max_num_seqs": 1, "max_num_batched_tokens": 64}}},
            "requests": refused_requests(),
        },
        {
            "name": "raising-key",
            "model": str(model),
            "engine": engine(1, 64),
            "cbcore": {"plugins": [PLUGIN], "scheduler": {"queue": {"name": "raise-on-five"}}},
            "requests": [
                {"id": "X", "prompt": [1, 7, 7, 7], "max_tokens": 3, "arrive": 0},
                {"id": "A", "prompt": [1, 8, 9, 10, 11], "max_tokens": 2, "arrive": 1},
                {"id": "B", "prompt": [1, 12, 13], "max_tokens": 2, "arrive": 6},  # after A's failure
            ],
        },
        {
            "name": "chunk-alone",
            "model": str(model),
            "engine": engine(2, 64),
            "cbcore": {"scheduler": {"budget": LIMITS, "prefill": CHUNK8}},
            "requests": chunk_requests(),
        },
        {
            "name": "whole-prompt-refused",
            "model": str(model),
            "engine": engine(2, 64),
            "cbcore": {"scheduler": {"prefill": {"name": "whole-prompt"}}},
            "requests": [],
        },
        {
            "name": "priority-default-refused",
            "model": str(model),
            "engine": engine(2, 64),
            "cbcore": {"scheduler": {"queue": {"name": "priority"}}},
            "requests": [],
        },
        *[
            {"name": name, "model": str(model), "engine": engine(1, 64), "cbcore": cbcore, "requests": []}
            for name, (cbcore, _) in CONFIG_ERRORS.items()
        ],
        {
            "name": "swap-refused",
            "model": str(model),
            "engine": engine(1, 64),
            "cbcore": {"scheduler": {"preemption": {"name": "swap"}}},
            "requests": [],
        },
    ]
    for rule in VICTIM_RULES:
        out.append(
            {
                "name": f"victim-{rule}",
                "model": str(model),
                "engine": engine(3, 128, num_gpu_blocks_override=TIGHT_BLOCKS + 1, max_model_len=TIGHT_BLOCKS * BLOCK),
                "cbcore": victim_config(rule) | {"clock": clock},
                "requests": preemption_requests(),
            }
        )
    for name, sched in EQUIVALENCE.items():
        out.append(
            {
                "name": name,
                "model": str(model),
                "engine": engine(2, 64),
                "cbcore": {"plugins": [PLUGIN], "scheduler": {"budget": LIMITS, **sched}, "clock": clock},
                "requests": trace(),
            }
        )
    return out


def preemption_config(log: Path) -> dict[str, Any]:
    return {
        "plugins": [PLUGIN],
        "scheduler": {
            "queue": {"name": "longest-prompt-first"},
            "budget": {"name": "token-budget", "max_num_seqs": 3, "max_num_batched_tokens": 128},
            "preemption": {"name": "evict-longest-prompt", "log": str(log)},
        },
    }


def test_the_driver_starts_with_the_session_and_runs_every_scenario(vllm_driver: tuple[Started, Path], runs: Any) -> None:
    """vllm_driver is started at the session's first test (vllm_helpers.vllm_starts_early), so that vLLM's
    start-up, over a minute of one core's work, overlaps the rest of the suite; the tests below read its results."""
    driver, work = vllm_driver
    assert "vllm_driver" in STARTED_EARLY
    assert driver.proc.returncode == 0, driver.log_tail()
    assert sorted(runs[0]) == sorted(s["name"] for s in scenarios(Path("model"), work))


@pytest.fixture(scope="module")
def runs(vllm_driver: tuple[Started, Path]) -> tuple[dict[str, Trace], Path]:
    driver, work = vllm_driver
    return driver_results(driver, work), work


def events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def ids(pairs: list[tuple[int, str]]) -> list[str]:
    return [rid for _, rid in pairs]


def step(trace: Trace, k: int) -> dict[str, int]:
    return next((s.scheduled for s in trace.steps if s.k == k), {})


def test_file_plugin_queue_decides_admission_order(runs: Any) -> None:
    results, work = runs
    r = results["admission"]
    assert r.error is None
    # Arrival order is X, A, B, C; the plugin serves the longest prompt first.
    assert ids(r.first_scheduled()) == ["X", "C", "B", "A"]
    arrivals = [e for e in events(work / "admission.jsonl") if e["event"] == "arrival"]
    assert [e["id"].rsplit("-", 1)[0] for e in arrivals] == ["X", "A", "B", "C"]
    assert [e["arrival_time"] for e in arrivals] == pytest.approx([0.0, 0.1, 0.1, 0.1])
    finished = [e["id"].rsplit("-", 1)[0] for e in events(work / "admission.jsonl") if e["event"] == "finish"]
    assert finished == ["X", "C", "B", "A"]


def test_preemption_plugin_chooses_the_victim(runs: Any, tiny_dir: Path, tmp_path: Path) -> None:
    results, work = runs
    r = results["preemption"]
    assert r.error is None and r.victims(), "the tight cache must force a preemption"
    victims = [e for e in events(work / "victims.jsonl") if e["event"] == "victim"]
    assert victims, "the policy was never asked"
    # vLLM's own fcfs rule would evict running[-1] (the last candidate); the plugin picks the longest prompt.
    first = victims[0]
    assert first["id"].rsplit("-", 1)[0] == "P3" and first["candidates"][-1].rsplit("-", 1)[0] == "P2"
    assert ids(r.victims()) == [e["id"].rsplit("-", 1)[0] for e in victims]
    config = preemption_config(tmp_path / "cbcore-victims.jsonl")
    config["kv_cache"] = {"block_size": BLOCK, "num_blocks": TIGHT_BLOCKS}
    ref = run_cbcore(tiny_dir, config, preemption_requests())
    assert ids(r.victims()) == ids(ref.victims())
    assert ids(r.first_scheduled()) == ids(ref.first_scheduled())
    assert r.output_lengths == {"P1": 40, "P2": 40, "P3": 40}


@pytest.mark.parametrize("rule", VICTIM_RULES)
def test_builtin_victims_match_cbcore_under_a_tight_cache(runs: Any, tiny_dir: Path, rule: str) -> None:
    results, _ = runs
    r = results[f"victim-{rule}"]
    assert r.error is None and r.victims(), "the tight cache must force a preemption"
    config = victim_config(rule) | {"kv_cache": {"block_size": BLOCK, "num_blocks": TIGHT_BLOCKS}}
    ref = run_cbcore(tiny_dir, config, preemption_requests())
    victims = ids(r.victims())
    assert victims == ids(ref.victims())
    # P1 has the lowest priority (the largest value); P3 is the newest (ties: id) and the least advanced.
    assert victims == (["P1", "P3"] if rule == "lowest-priority" else ["P3", "P1"])
    assert ids(r.first_scheduled()) == ids(ref.first_scheduled())
    k = r.victims()[0][0]
    assert ref.victims()[0][0] == k
    if rule == "lowest-priority":  # P3 asks for a block and P1 is evicted: the same steps throughout
        assert r.victims() == ref.victims()
        assert [step(r, i) for i in range(k + 1)] == [step(ref, i) for i in range(k + 1)]
    else:
        # P3 asks and is its own victim. Documented difference (self-victim-ends-loop): vLLM 0.32.0 then
        # ends its running loop, so P1 (after P3 in running order) waits a step; cbcore goes on and decodes P1.
        assert step(r, k) == {"P2": 1}
        assert step(ref, k) == {"P2": 1, "P1": 1}
        assert r.victims()[1][0] == ref.victims()[1][0] + 1
        report = compare(ref, r, applicable(load(), "0.32.0", "sync"))
        steps = next(a for a in report.aspects if a.name == "steps")
        assert steps.explanation is not None and steps.explanation.difference.id == "self-victim-ends-loop"
        assert not report.unexplained


@pytest.mark.parametrize("policy", sorted(EQUIVALENCE))
def test_first_scheduled_order_matches_cbcore(runs: Any, tiny_dir: Path, policy: str) -> None:
    results, _ = runs
    r = results[policy]
    assert r.error is None
    config = {
        "plugins": [PLUGIN],
        "scheduler": {"budget": LIMITS, **EQUIVALENCE[policy]},
        "kv_cache": {"block_size": BLOCK, "num_blocks": ROOMY["num_gpu_blocks_override"] - 1},
    }
    ref = run_cbcore(tiny_dir, config, trace())
    assert ids(r.first_scheduled()) == ids(ref.first_scheduled())
    assert r.victims() == ref.victims() == []
    assert r.output_lengths == ref.output_lengths
    assert not compare(ref, r, applicable(load(), "0.32.0", "sync")).unexplained


def test_policies_disagree_on_the_trace(runs: Any) -> None:
    """The trace must tell the policies apart, or the equivalence above proves little."""
    results, _ = runs
    orders = {tuple(ids(results[p].first_scheduled())) for p in EQUIVALENCE}
    assert len(orders) >= 4, orders


def test_misbehaving_plugin_gets_cbcore_named_error(runs: Any) -> None:
    results, _ = runs
    err = results["garbage-order"].error
    assert err is not None and "PolicyError" in err  # about no single request: vLLM's engine stops, named
    assert "queue policy 'garbage-order' (path " in err
    assert "broke the rule 'order() returns each given sequence exactly once'" in err


def test_chunk_of_a_prefill_alone_differs_as_documented(runs: Any, tiny_dir: Path) -> None:
    """docs/vllm.md: vLLM caps a prefill at long_prefill_token_threshold only when it is not alone."""
    results, _ = runs
    r = results["chunk-alone"]
    assert r.error is None
    config = {"scheduler": {"budget": LIMITS, "prefill": CHUNK8}, "kv_cache": {"block_size": BLOCK, "num_blocks": 200}}
    ref = run_cbcore(tiny_dir, config, chunk_requests())
    assert r.steps[0].scheduled == {"L": 30}  # alone: the whole budget
    assert ref.steps[0].scheduled == {"L": 8}  # cbcore: chunk_size regardless
    together = {"M": 8, "N": 8}  # with company both engines chunk at chunk_size
    assert together in [s.scheduled for s in r.steps] and together in [s.scheduled for s in ref.steps]
    assert ids(r.first_scheduled()) == ids(ref.first_scheduled()) == ["L", "M", "N"]
    report = compare(ref, r, applicable(load(), "0.32.0", "sync"))
    steps = next(a for a in report.aspects if a.name == "steps")
    assert steps.k == 0 and steps.explanation is not None and steps.explanation.difference.id == "prefill-alone"


def test_whole_prompt_needs_a_budget_for_the_longest_prompt(runs: Any) -> None:
    results, _ = runs
    err = results["whole-prompt-refused"].error
    assert err is not None and "prefill policy 'whole-prompt' (built-in)" in err
    assert "--max-num-batched-tokens >= --max-model-len (64 < 256)" in err


def test_swap_preemption_is_refused_at_start(runs: Any) -> None:
    results, _ = runs
    err = results["swap-refused"].error
    assert err is not None and "preemption policy 'swap' (built-in)" in err and "recompute only" in err


def test_bad_request_fields_refuse_that_request_alone(runs: Any) -> None:
    results, work = runs
    r = results["refusals"]
    assert r.error is None
    assert r.finish == {"X": "length", "A": "error", "B": "error", "C": "length"}
    assert ids(r.first_scheduled()) == ["X", "C"]
    log = (work / "driver.log").read_text()
    assert "vllm_xargs: deadline_s must be finite and > 0, got -1" in log
    assert "attrs must be a JSON object (or its JSON text)" in log


def test_a_plugin_raising_about_one_request_ends_it_alone_and_vllm_serves_on(runs: Any) -> None:
    results, work = runs
    r = results["raising-key"]
    assert r.error is None  # vLLM's engine lives on
    assert r.finish == {"X": "length", "A": "error", "B": "length"}
    # The log names the request key() was looking at, as cbcore's engine does: A, the five-token prompt.
    log = (work / "driver.log").read_text()
    assert re.search(r"raised in key\(\) for request 'A-[0-9a-f]+': ZeroDivisionError: division by zero", log)


def test_queue_preempting_running_requests_is_refused_at_start(runs: Any) -> None:
    results, _ = runs
    err = results["priority-default-refused"].error
    assert err is not None and err.startswith("RefusedPolicy: queue policy 'priority' (built-in): preemptive admission")
    assert "never to admit a waiting one; set preempt_running: false" in err


@pytest.mark.parametrize("name", sorted(CONFIG_ERRORS))
def test_config_errors_name_the_key_and_the_reason(runs: Any, name: str) -> None:
    results, _ = runs
    err = results[name].error
    assert err is not None and CONFIG_ERRORS[name][1] in err, err
