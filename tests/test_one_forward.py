"""A step with three decodes and a new prompt is a single model forward."""

from __future__ import annotations

import pytest

from cbcore import Engine, EngineConfig, SamplingParams


@pytest.mark.parametrize("forward", ["fused", "hf"])
def test_three_decodes_and_a_new_prompt_share_one_forward(models, forward):
    model = models["llama"]
    config = {"backend": {"name": "eager"}, "execution": {"forward": forward}}
    engine = Engine(model, config=EngineConfig.model_validate(config))
    params = SamplingParams(max_new_tokens=8)
    for prompt in ([5, 6, 7], [8, 9], [10, 11, 12, 13]):
        engine.add_request(prompt, params)
    engine.step()  # the three prompts prefill together
    engine.add_request([14, 15, 16, 17, 18], params)

    calls = []
    # Both forwards embed the step's tokens once: one call of the embedding is one forward.
    handle = model.get_input_embeddings().register_forward_hook(lambda module, args, out: calls.append(1))
    try:
        outputs = engine.step()
    finally:
        handle.remove()

    stats = engine.step_stats[-1]
    assert len(calls) == 1
    assert stats.num_seqs == 4
    assert stats.num_decode_tokens == 3 and stats.num_prefill_tokens == 5
    assert len(outputs) == 4, "each of the four sequences got a token from that one forward"
