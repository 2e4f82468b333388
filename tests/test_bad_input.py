"""Bad input is refused with a message that names the problem, and hurts nobody else."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from cbcore import Engine, EngineConfig, RequestError, SamplingParams
from cbcore.scheduling.sequence import SequenceStatus

EAGER = {"backend": {"name": "eager"}}


def engine_for(model, **extra):
    return Engine(model, config=EngineConfig.model_validate({**EAGER, **extra}))


def test_empty_prompt(models):
    with pytest.raises(RequestError, match="prompt is empty"):
        engine_for(models["llama"]).add_request([])


def test_prompt_longer_than_the_context(models):
    engine = engine_for(models["gpt2"])  # 512 positions
    with pytest.raises(RequestError, match="model's context of 512"):
        engine.add_request([5] * 600)


def test_token_outside_vocabulary(models):
    with pytest.raises(RequestError, match="outside the vocabulary"):
        engine_for(models["llama"]).add_request([5, 10_000])


def test_text_prompt_without_tokenizer(models):
    with pytest.raises(RequestError, match="needs a tokenizer"):
        engine_for(models["llama"]).add_request("hello")


@pytest.mark.parametrize("bad", [{"max_new_tokens": 0}, {"max_new_tokens": -3}, {"temperature": -1.0}])
def test_invalid_sampling_params(bad):
    with pytest.raises(ValidationError, match=next(iter(bad))):
        SamplingParams(**bad)


def test_top_k_without_temperature_is_refused():
    with pytest.raises(ValidationError, match="top_k/top_p only apply when temperature >= 1e-05"):
        SamplingParams(top_k=5)


def test_prompt_that_never_fits_fails_alone(models):
    engine = engine_for(models["llama"], kv_cache={"block_size": 4, "num_blocks": 8})  # 32 tokens
    prompts = [[5, 6, 7], [9] * 40, [11, 12]]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=4))
    assert [o.finish_reason for o in outs] == ["length", "error", "length"]
    assert "holds 32" in outs[1].error and "kv_cache.num_blocks" in outs[1].error
    assert len(outs[0].output_token_ids) == 4 and len(outs[2].output_token_ids) == 4


def test_request_that_outgrows_the_cache_fails_without_hanging(models):
    # Fits at admission (20 tokens), but 20 + 30 generated needs 50 > 32 slots.
    engine = engine_for(models["llama"], kv_cache={"block_size": 4, "num_blocks": 8})
    outs = engine.generate(
        [[5] * 20, [6, 7]], [SamplingParams(max_new_tokens=30), SamplingParams(max_new_tokens=5)]
    )
    assert outs[0].finish_reason == "error" and "needs" in outs[0].error
    assert outs[1].finish_reason == "length" and len(outs[1].output_token_ids) == 5
    assert engine.scheduler.blocks.num_free_blocks == 8


def test_abort_of_a_running_request_frees_its_blocks(models):
    engine = engine_for(models["llama"], kv_cache={"block_size": 4, "num_blocks": 32})
    keep = engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=6))
    victim = engine.add_request([8] * 13, SamplingParams(max_new_tokens=50))
    engine.step()
    engine.step()
    seq = engine.scheduler.get(victim)
    assert seq.status is SequenceStatus.RUNNING and len(seq.block_table) == 4
    used = engine.scheduler.blocks.num_used_blocks
    assert engine.abort(victim)
    assert engine.scheduler.blocks.num_used_blocks == used - 4
    assert not engine.abort(victim), "a second abort finds nothing"
    finished = {}
    while engine.has_unfinished():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert list(finished) == [keep] and finished[keep].finish_reason == "length"
    assert engine.scheduler.blocks.num_free_blocks == 32


def test_abort_of_a_waiting_request(models):
    engine = engine_for(models["llama"])
    rid = engine.add_request([5, 6])
    assert engine.abort(rid)
    assert not engine.has_unfinished()


def test_duplicate_request_id(models):
    engine = engine_for(models["llama"])
    engine.add_request([5], request_id="a")
    with pytest.raises(RequestError, match="already in use"):
        engine.add_request([6], request_id="a")


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        ({"kv_cach": {}}, "kv_cach"),
        ({"kv_cache": {"block_sizes": 8}}, "kv_cache.block_sizes"),
        ({"kv_cache": {"block_size": 0}}, "kv_cache.block_size"),
        ({"scheduler": {"queues": {"name": "fcfs"}}}, "scheduler.queues"),
        ({"model": {"dtype": "float8"}}, "model.dtype"),
    ],
)
def test_unknown_or_bad_config_keys_are_named(config, needle):
    with pytest.raises(ValidationError, match=needle.replace(".", r"\.")):
        EngineConfig.model_validate(config)


def test_generate_wants_a_list_of_prompts(models):
    with pytest.raises(TypeError, match="list of prompts"):
        engine_for(models["llama"]).generate([5, 6, 7])
