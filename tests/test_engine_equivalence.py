"""fp32 greedy: the engine's tokens equal HF generate() on each prompt alone.

Each scenario forces one hard path and asserts that it really happened:
slot reuse, preemption under a tiny KV cache, prefill and decode sharing steps.
"""

from __future__ import annotations

import pytest
from support import CAPS, PROMPTS

from cbcore import Engine, EngineConfig, SamplingParams
from cbcore.testing import assert_equivalent, compare_greedy

SCENARIOS = {
    # 16 prompts through 4 slots: sequences leave and others take their place.
    "slot-reuse": {"scheduler": {"budget": {"name": "token-budget", "max_num_seqs": 4}}},
    # 40 blocks of 4 = 160 tokens, exactly the longest request: preemption is certain.
    "tiny-kv": {
        "kv_cache": {"block_size": 4, "num_blocks": 40},
        "scheduler": {"budget": {"name": "token-budget", "max_num_seqs": 8, "max_num_batched_tokens": 256}},
    },
    # A 24-token budget: prompt chunks ride along with decodes.
    "small-budget": {
        "scheduler": {
            "budget": {"name": "token-budget", "max_num_seqs": 8, "max_num_batched_tokens": 24},
            "prefill": {"name": "chunked-prefill"},
        }
    },
}


def run(model, scenario: str, backend: str = "eager") -> Engine:
    config = EngineConfig.model_validate({**SCENARIOS[scenario], "backend": {"name": backend}})
    engine = Engine(model, config=config)
    engine.outputs = engine.generate(PROMPTS, [SamplingParams(max_new_tokens=c) for c in CAPS])
    return engine


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_engine_matches_per_prompt_generate(models, references, family, scenario):
    engine = run(models[family], scenario)
    assert_equivalent(compare_greedy(models[family], engine.outputs, references[family]))
    assert [len(o.output_token_ids) for o in engine.outputs] == [len(r.token_ids) for r in references[family]]
    blocks = engine.scheduler.blocks
    assert blocks.num_free_blocks == blocks.num_blocks, "every KV block is free after the run"

    stats = engine.step_stats
    if scenario == "slot-reuse":
        assert max(s.num_seqs for s in stats) == 4
        assert sum(s.num_prefill_tokens > 0 for s in stats) > 1, "later prompts joined a running batch"
    if scenario == "tiny-kv":
        assert engine.scheduler.num_preemptions > 0
        assert max(o.metrics.num_preemptions for o in engine.outputs) > 0
    if scenario == "small-budget":
        assert any(s.is_mixed for s in stats), "some step carried prefill and decode tokens together"
        assert engine.scheduler.num_partial_prefills > 0, "some prompt was split into chunks"
        assert max(s.num_tokens for s in stats) <= 24


def test_outputs_come_back_in_prompt_order(models):
    engine = run(models["llama"], "slot-reuse")
    assert [o.prompt_token_ids for o in engine.outputs] == PROMPTS
    assert all(o.finish_reason == "length" for o in engine.outputs)
