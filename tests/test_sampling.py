"""Sampling: each request's random stream is its own."""

from __future__ import annotations

import torch

from cbcore import Engine, EngineConfig, SamplingParams
from cbcore.execution.sampler import sample
from cbcore.scheduling.sequence import Sequence

EAGER = EngineConfig.model_validate({"backend": {"name": "eager"}})


def test_seeded_request_ignores_its_batch_mates(models):
    model = models["llama"]
    seeded = SamplingParams(max_new_tokens=24, temperature=0.9, top_k=50, top_p=0.95, seed=1234)
    alone = Engine(model, config=EAGER).generate([[5, 6, 7, 8]], seeded)[0]

    noise = [SamplingParams(max_new_tokens=n, temperature=1.3, seed=s) for n, s in ((30, 1), (5, 2), (17, 3))]
    crowd = Engine(model, config=EAGER).generate(
        [[9, 10], [5, 6, 7, 8], [11] * 20, [12, 13, 14]], [noise[0], seeded, noise[1], noise[2]]
    )[1]
    assert crowd.output_token_ids == alone.output_token_ids
    greedy = Engine(model, config=EAGER).generate([[5, 6, 7, 8]], SamplingParams(max_new_tokens=24))[0]
    assert alone.output_token_ids != greedy.output_token_ids, "sampling at T=0.9 must differ from argmax"


def test_seeded_request_survives_preemption(models):
    model = models["llama"]
    params = [SamplingParams(max_new_tokens=40, temperature=1.0, seed=i) for i in range(6)]
    prompts = [[5 + i] * (3 + i) for i in range(6)]
    roomy = Engine(model, config=EAGER).generate(prompts, params)
    tight_config = EngineConfig.model_validate(
        {"backend": {"name": "eager"}, "kv_cache": {"block_size": 4, "num_blocks": 14}}
    )
    tight = Engine(model, config=tight_config)
    outs = tight.generate(prompts, params)
    assert tight.scheduler.num_preemptions > 0
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in roomy]


def _seq(**params) -> Sequence:
    return Sequence(request_id="r", prompt_token_ids=[1], params=SamplingParams(**params))


def test_top_k_one_and_tiny_top_p_are_argmax():
    logits = torch.randn(3, 100)
    argmax = logits.argmax(-1).tolist()
    for params in (
        {"temperature": 1.0, "top_k": 1, "seed": 0},
        {"temperature": 1.0, "top_p": 1e-6, "seed": 0},
    ):
        tokens, _ = sample(logits, [_seq(**params) for _ in range(3)])
        assert tokens == argmax


def test_greedy_takes_the_first_of_tied_maxima_as_hf_argmax_does():
    logits = torch.zeros(4, 60)
    logits[0, [9, 3, 41]] = 5.0
    logits[2, [59, 58]] = 2.0
    logits[3] = float("-inf")
    tokens, _ = sample(logits, [_seq() for _ in range(4)])
    assert tokens == logits.argmax(-1).tolist() == [3, 0, 58, 0]


def test_top_k_never_samples_outside_the_k_best():
    logits = torch.randn(1, 50)
    allowed = set(logits[0].topk(5).indices.tolist())
    seq = _seq(temperature=5.0, top_k=5, seed=7)
    drawn = {sample(logits, [seq])[0][0] for _ in range(200)}
    assert drawn <= allowed and len(drawn) > 1


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seq = _seq(temperature=1.0, top_p=0.8, seed=3)
    drawn = {sample(logits, [seq])[0][0] for _ in range(300)}
    assert drawn == {0, 1}


def test_logprobs_are_reported_for_the_chosen_and_top_tokens():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    tokens, top = sample(logits, [_seq(logprobs=2)])
    assert tokens == [1]
    expected = torch.log_softmax(logits[0], -1)
    assert set(top[0]) == {1, 2}
    assert abs(top[0][1] - float(expected[1])) < 1e-6
