"""engine_load(): the snapshot that /metrics, routers and benchmarks read."""

from __future__ import annotations

import dataclasses

import pytest

from cbcore import Engine, EngineConfig, EngineLoad, SamplingParams, engine_load
from cbcore.testing import random_prompts


def test_load_follows_requests_through_the_engine(models):
    config = EngineConfig.from_dict(
        {"kv_cache": {"block_size": 4, "num_blocks": 64}, "scheduler": {"budget": {"max_num_seqs": 2}}}
    )
    engine = Engine(models["llama"], None, config)
    idle = engine_load(engine)
    assert idle == EngineLoad(0, 0, 0, 0, 64, 0)
    assert idle.kv_usage == 0.0
    prompts = random_prompts(3, 5, 9, seed=1)
    for ids in prompts:
        engine.add_request(ids, SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert engine_load(engine).num_waiting == 3
    engine.step()
    load = engine_load(engine)
    assert (load.num_waiting, load.num_running) == (1, 2)
    assert load.kv_blocks_used == sum(len(s.block_table) for s in engine.scheduler.running)
    assert 0 < load.kv_usage <= 1
    while engine.has_unfinished():
        engine.step()
    # Back to idle; the prefix cache looked up every prompt once (no shared prefix: no hits).
    assert dataclasses.replace(engine_load(engine), recent_step_s=0.0) == dataclasses.replace(
        idle, prefix_cache_queries_tokens=sum(map(len, prompts))
    )
    assert engine_load(engine).recent_step_s > 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        load.num_running = 0  # type: ignore[misc]


def test_preemptions_are_counted_for_any_scheduler(models):
    # 6 blocks of 4 tokens cannot hold three growing sequences: preemptions must happen.
    config = EngineConfig.from_dict({"kv_cache": {"block_size": 4, "num_blocks": 6}})
    engine = Engine(models["llama"], None, config)
    engine.generate(random_prompts(3, 6, 7, seed=2), SamplingParams(max_new_tokens=10, ignore_eos=True))
    assert engine_load(engine).num_preemptions_total == engine.scheduler.num_preemptions > 0
    assert engine_load(engine).kv_blocks_used == 0
