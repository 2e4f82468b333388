"""The engine's KV accounting under random workloads: nothing owned twice, nothing leaked."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import HealthCheck, given, settings

from cbcore import Engine, EngineConfig, SamplingParams
from cbcore.testing.block_invariants import check_blocks

REQUESTS = st.lists(
    st.tuples(st.integers(1, 30), st.integers(1, 20), st.integers(0, 2)), min_size=1, max_size=10
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    requests=REQUESTS,
    num_blocks=st.integers(13, 24),
    preemption=st.sampled_from(["recompute", "swap"]),
    abort_every=st.integers(0, 5),
)
def test_random_workloads_keep_blocks_consistent(models, requests, num_blocks, preemption, abort_every):
    config = EngineConfig.model_validate(
        {
            "backend": {"name": "eager"},
            "kv_cache": {"block_size": 4, "num_blocks": num_blocks, "num_host_blocks": 8},
            "scheduler": {
                "queue": {"name": "priority"},
                "budget": {"name": "token-budget", "max_num_seqs": 4, "max_num_batched_tokens": 16},
                "preemption": {"name": preemption, "victim": "least-progress"},
            },
        }
    )
    engine = Engine(models["llama"], config=config)
    ids = [
        engine.add_request([7] * plen, SamplingParams(max_new_tokens=gen), priority=prio)
        for plen, gen, prio in requests
    ]
    sched = engine.scheduler
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        check_blocks(sched.blocks, sched.running)
        assert all(not s.block_table for s in sched.waiting + sched.swapped)
        if abort_every and steps % abort_every == 0 and sched.running:
            engine.abort(sched.running[-1].request_id)
        assert steps < 2000, "the engine must always make progress"
    assert sched.blocks.num_free_blocks == num_blocks
    assert sched.blocks.num_free_host_blocks == 8
    assert len(ids) == len(requests)
