"""Prefix caching as the scheduler and policies see it: skipped prefill, budgets, `lpm`, salts, counters."""

from __future__ import annotations

import pytest

from cbcore import Engine, EngineConfig, SamplingParams, engine_load
from cbcore.engine import RequestError
from cbcore.testing import random_prompts
from cbcore.testing.block_invariants import check_blocks

STEM = random_prompts(1, 40, 40, seed=7)[0]  # ten blocks of 4


def engine_for(
    models, *, queue="fcfs", caching=True, seqs=4, tokens=64, prefill="whole-prompt", **queue_params
):
    config = EngineConfig.model_validate(
        {
            "scheduler": {
                "queue": {"name": queue, **queue_params},
                "budget": {"name": "token-budget", "max_num_seqs": seqs, "max_num_batched_tokens": tokens},
                "prefill": {"name": prefill},
            },
            "kv_cache": {"block_size": 4, "num_blocks": 64, "prefix_caching": caching},
        }
    )
    return Engine(models["llama"], config=config)


def scheduled_tokens(engine: Engine) -> list[dict[str, int]]:
    """Per step: request id -> tokens computed, recorded by a step listener."""
    steps: list[dict[str, int]] = []
    engine.step_listeners.append(
        lambda record: steps.append({s.seq.request_id: s.num_tokens for s in record.output.scheduled})
    )
    return steps


def test_a_hit_skips_the_cached_prefill_and_the_budget_counts_only_computed_tokens(models):
    engine = engine_for(models, tokens=16)
    engine.generate([[*STEM, 5]], SamplingParams(max_new_tokens=2))  # 41 tokens: over the budget, runs alone
    steps = scheduled_tokens(engine)
    engine.add_request([*STEM, 9, 10, 11], SamplingParams(max_new_tokens=1), request_id="hit")
    engine.step()
    assert steps[-1] == {"hit": 3}, "40 cached tokens are skipped; the 3 new ones fit the budget of 16"
    stats = engine.step_stats[-1]
    assert (stats.prefix_cache_queries_tokens, stats.prefix_cache_hits_tokens) == (43, 40)
    load = engine_load(engine)
    assert (load.prefix_cache_queries_tokens, load.prefix_cache_hits_tokens) == (41 + 43, 40)


def test_a_fully_cached_prompt_still_computes_its_last_block(models):
    engine = engine_for(models)
    first = engine.generate([STEM], SamplingParams(max_new_tokens=3))[0]
    steps = scheduled_tokens(engine)
    again = engine.generate([STEM], SamplingParams(max_new_tokens=3))[0]
    assert again.output_token_ids == first.output_token_ids
    assert steps[0] == {again.request_id: 4}, "the last block is recomputed so the step samples"
    assert (again.metrics.prefix_cache_queries, again.metrics.prefix_cache_hits) == (40, 36)
    assert (first.metrics.prefix_cache_queries, first.metrics.prefix_cache_hits) == (40, 0)


def test_caching_off_hits_nothing(models):
    engine = engine_for(models, caching=False)
    engine.generate([STEM, STEM], SamplingParams(max_new_tokens=2))
    engine.generate([STEM], SamplingParams(max_new_tokens=2))
    blocks = engine.scheduler.blocks
    assert blocks.prefix_cache_hits_tokens == blocks.prefix_cache_queries_tokens == 0
    assert blocks.num_cached_blocks == 0


def test_salts_keep_tenants_apart(models):
    engine = engine_for(models)
    engine.add_request([*STEM, 3], SamplingParams(max_new_tokens=1), cache_salt="tenant-a")
    while engine.has_unfinished():
        engine.step()
    for rid, salt, hit in (("b", "tenant-b", 0), ("none", None, 0), ("a", "tenant-a", 40)):
        engine.add_request([*STEM, 4], SamplingParams(max_new_tokens=1), request_id=rid, cache_salt=salt)
        engine.step()
        assert engine.step_stats[-1].prefix_cache_hits_tokens == hit, rid
    with pytest.raises(RequestError, match="cache_salt must be a string"):
        engine.add_request([1, 2, 3], cache_salt=7)  # type: ignore[arg-type]


def admission_order(engine: Engine, prompts: dict[str, list[int]]) -> list[str]:
    for rid, prompt in prompts.items():
        engine.add_request(prompt, SamplingParams(max_new_tokens=1), request_id=rid)
    order: list[str] = []
    while engine.has_unfinished():
        order.extend(out.request_id for out in engine.step() if out.finished)
    return order


@pytest.mark.parametrize(
    ("queue", "params", "expected"),
    [
        ("lpm", {}, ["long", "short", "cold"]),
        ("lpm", {"fcfs_above": 1}, ["cold", "short", "long"]),  # more waiting than the limit: FCFS
        ("fcfs", {}, ["cold", "short", "long"]),
    ],
)
def test_lpm_serves_the_longest_cached_prefix_first(models, queue, params, expected):
    engine = engine_for(models, queue=queue, seqs=1, **params)
    engine.generate([[*STEM, 3]], SamplingParams(max_new_tokens=1))  # warm the cache with STEM
    order = admission_order(
        engine,
        {"cold": random_prompts(1, 30, 30, seed=8)[0], "short": [*STEM[:12], 7, 7], "long": [*STEM, 7, 7]},
    )
    assert order == expected


def test_a_policy_that_raises_during_admission_leaves_no_block_mapped(models):
    engine = engine_for(models)
    engine.generate([[*STEM, 3]], SamplingParams(max_new_tokens=1))  # STEM is cached
    engine.add_request([*STEM, 4, 5], SamplingParams(max_new_tokens=1), request_id="hit")
    sched = engine.scheduler
    prefill = sched.door.prefill
    real = prefill.num_tokens

    def broken(seq, tokens_left, scheduled):
        raise RuntimeError("prefill policy bug")

    prefill.num_tokens = broken
    out = engine.step()  # the request the failing call concerned ends; nothing it mapped stays held
    assert [(o.request_id, o.finish_reason) for o in out] == [("hit", "error")]
    assert "num_tokens()" in out[0].error and sched.get("hit") is None
    check_blocks(sched.blocks, sched.running)
    assert sched.blocks.num_used_blocks == 0
    prefill.num_tokens = real
    engine.add_request([*STEM, 4, 5], SamplingParams(max_new_tokens=1), request_id="again")
    out = engine.step()  # admitted normally afterwards, with its hit
    assert [o.request_id for o in out] == ["again"] and engine.step_stats[-1].prefix_cache_hits_tokens == 40
