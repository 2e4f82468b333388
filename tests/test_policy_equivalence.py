"""fp32 greedy equivalence for every policy, alone and mixed, under forced preemption and chunking.

Each run checks the contract (every request's tokens equal HF ``generate`` on
its prompt alone) and that the hard paths really ran: preemptions, partial
prefill chunks where the prefill policy chunks, swaps for ``swap``, and steps
that mix prefill and decode tokens. A step listener also checks, on the real
engine, that the token budget holds under chunked prefill and that no request
emits a token from a step that did not complete its pending tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from support import CAPS, CLIENTS, PRIORITIES, PROMPTS

from cbcore.config import SLOTS, EngineConfig
from cbcore.engine import Engine, StepRecord
from cbcore.scheduling.sampling_params import SamplingParams
from cbcore.testing import assert_equivalent, compare_greedy
from cbcore.testing.mixes import CONTRIB_QUEUES, SMALL_KV, available_mixes

# The readable reference backend; the backend x policy matrix lives with the backends.
BACKEND = {"name": "eager"}
FAMILY = "llama"

# One slot changed at a time from a base that forces memory pressure and chunking.
PRESSURE_BASE: dict[str, Any] = {
    "budget": {"name": "token-budget", "max_num_seqs": 6, "max_num_batched_tokens": 32},
    "prefill": {"name": "chunked-prefill"},
}
ALONE: dict[str, dict[str, Any]] = {
    "priority": {"queue": {"name": "priority", "aging_s": 5.0}},
    "static": {"budget": {"name": "static", "max_num_seqs": 4, "max_num_batched_tokens": 32}},
    "whole-prompt": {"prefill": {"name": "whole-prompt"}},
    "swap": {"preemption": {"name": "swap", "victim": "least-progress"}},
}
ALONE_PROMPTS = list(range(8))  # half the prompt set keeps these runs short; still preempts


@dataclass
class Observed:
    budget: int | None
    violations: list[str] = field(default_factory=list)
    swapped: int = 0
    mixed_steps: int = 0

    def __call__(self, record: StepRecord) -> None:
        stats, out, batch = record.stats, record.output, record.batch
        self.swapped += len(out.swap_out)
        self.mixed_steps += bool(stats.num_prefill_tokens and stats.num_decode_tokens)
        if self.budget is not None and stats.num_tokens > self.budget:
            self.violations.append(f"step {stats.step}: {stats.num_tokens} tokens > budget {self.budget}")
        if batch is None:
            return
        sampled = {out.scheduled[i].seq.request_id for i in batch.sample_rows}
        emitted = {o.request_id for o in record.outputs if o.new_token_ids}
        if emitted - sampled:
            self.violations.append(f"step {stats.step}: {sorted(emitted - sampled)} emitted mid-prefill")


def run_config(models: dict, references: dict, config: dict[str, Any], indices: list[int]) -> Engine:
    cfg = EngineConfig.model_validate({**config, "backend": BACKEND})
    sched = cfg.scheduler
    chunked = sched.prefill.name == "chunked-prefill"
    budget = sched.budget.params.get("max_num_batched_tokens") if chunked else None
    model = models[FAMILY]
    engine = Engine(model, None, cfg)
    observed = Observed(budget)
    engine.step_listeners.append(observed)
    outputs = engine.generate(
        [PROMPTS[i] for i in indices],
        [SamplingParams(max_new_tokens=CAPS[i]) for i in indices],
        priorities=[PRIORITIES[i] for i in indices],
        client_ids=[CLIENTS[i] for i in indices],
    )
    assert_equivalent(compare_greedy(model, outputs, [references[FAMILY][i] for i in indices]))
    scheduler = engine.scheduler
    assert not observed.violations, observed.violations
    assert scheduler.num_preemptions > 0, "no preemption happened: the KV cache was not tight enough"
    assert observed.mixed_steps > 0, "no step mixed prefill and decode tokens"
    if chunked:
        assert scheduler.num_partial_prefills > 0, "no prompt was split into chunks"
    if sched.preemption.name == "swap":
        assert observed.swapped > 0 and scheduler.num_swap_fallbacks == 0
    return engine


@pytest.mark.parametrize("mix", sorted(available_mixes()))
def test_policy_mix_matches_reference(mix: str, models: dict, references: dict) -> None:
    run_config(models, references, available_mixes()[mix], list(range(len(PROMPTS))))


@pytest.mark.parametrize("policy", sorted(ALONE))
def test_policy_alone_matches_reference(policy: str, models: dict, references: dict) -> None:
    config = {"scheduler": {**PRESSURE_BASE, **ALONE[policy]}, "kv_cache": SMALL_KV}
    run_config(models, references, config, ALONE_PROMPTS)


def test_every_policy_is_exercised() -> None:
    """Every registered built-in and contrib policy appears in a mix or an alone run above."""
    from cbcore.plugins import get_registry

    registry = get_registry()
    configs = [m["scheduler"] for m in available_mixes().values()]
    configs += [{**PRESSURE_BASE, **alone} for alone in ALONE.values()]
    used = {(slot, spec["name"]) for c in configs for slot, spec in c.items() if slot in SLOTS}
    used |= {("queue", "fcfs"), ("preemption", "recompute")}  # the engine's defaults in PRESSURE_BASE
    wanted = {
        (e.kind, e.name)
        for e in registry.entries()
        if e.kind in ("queue", "budget", "prefill", "preemption")
        and (e.origin == "built-in" or e.name in CONTRIB_QUEUES)
    }
    assert wanted - used == set()
    assert {name for kind, name in used if kind == "queue"} >= set(CONTRIB_QUEUES), (
        "a contrib policy is missing"
    )
