"""Sampled tokens come from softmax(logits / temperature), cut by top-k and top-p exactly where documented.

The statistical bound: a token of probability p drawn n times appears
n*p +- 5*sqrt(n*p*(1-p)) times (plus one for rounding), and a token with
probability 0 never appears. Each test draws at a fixed seed, so it is
deterministic; a correct sampler lands outside the bound for a given token
with probability below 1e-6, while a temperature applied the wrong way
(multiplied, or ignored) moves the likeliest tokens by more than 20 such
standard deviations at these sizes.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from cbcore import Engine, EngineConfig, SamplingParams
from cbcore.execution.sampler import sample
from cbcore.scheduling.plan import RowPlan

SIGMAS = 5.0
DRAWS = 6000


def draws(logits: list[float], n: int = DRAWS, seed: int = 0, **params: float) -> Counter[int]:
    """``n`` tokens drawn by :func:`sample` from one row of ``logits``, with one seeded generator."""
    generator = torch.Generator().manual_seed(seed)
    row = RowPlan([0], 0, [], SamplingParams(**params), generator)
    tokens, _ = sample(torch.tensor([logits]).expand(n, -1), [row] * n)
    return Counter(tokens)


def assert_frequencies(counts: Counter[int], probs: torch.Tensor) -> None:
    """Every token's count within the bound of the module's docstring; tokens of probability 0 never drawn."""
    n = sum(counts.values())
    off = []
    for token, p in enumerate(probs.tolist()):
        got = counts.get(token, 0)
        if p == 0.0:
            if got:
                off.append(f"token {token}: probability 0, drawn {got} times")
            continue
        bound = SIGMAS * math.sqrt(n * p * (1 - p)) + 1
        if abs(got - n * p) > bound:
            off.append(f"token {token}: drawn {got} times, expected {n * p:.1f} +- {bound:.1f}")
    assert not off, f"{n} draws do not follow the distribution:\n" + "\n".join(off)


LOGITS = [2.0, 1.0, 0.5, 0.0, -1.0, -2.0]


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_sampled_frequencies_follow_the_softmax_of_the_logits_over_the_temperature(temperature):
    counts = draws(LOGITS, temperature=temperature)
    assert_frequencies(counts, torch.softmax(torch.tensor(LOGITS) / temperature, -1))


def test_top_k_keeps_exactly_the_k_best_at_their_renormalised_odds():
    logits = [0.3, 1.0, -0.2, 0.9, 0.0, 0.8, 0.1, -0.5]  # the three best: tokens 1, 3, 5
    counts = draws(logits, temperature=0.8, top_k=3)
    assert set(counts) == {1, 3, 5}
    kept = torch.full((8,), float("-inf"))
    kept[[1, 3, 5]] = torch.tensor(logits)[[1, 3, 5]] / 0.8
    assert_frequencies(counts, torch.softmax(kept, -1))


def _exact_probs(logits: list[float], expected: list[float]) -> None:
    """The construction's premise: these logits give exactly these probabilities in float32."""
    assert torch.softmax(torch.tensor(logits), -1).tolist() == expected


@pytest.mark.parametrize("kept", [1, 3, 5, 8])
def test_top_p_drops_a_token_exactly_when_the_mass_before_it_reaches_top_p(kept):
    """Eight equal tokens of 1/8 each: top_p = kept/8 keeps exactly ``kept`` of them, equally often."""
    _exact_probs([0.0] * 8, [0.125] * 8)
    counts = draws([0.0] * 8, temperature=1.0, top_p=kept / 8)
    assert len(counts) == kept, f"top_p={kept}/8 kept {len(counts)} tokens"
    probs = torch.zeros(8)
    probs[list(counts)] = 1 / kept
    assert_frequencies(counts, probs)


@pytest.mark.parametrize(
    ("top_p", "odds"),
    [
        (0.5, [1.0, 0, 0, 0]),
        (0.5 + 1e-6, [2 / 3, 1 / 3, 0, 0]),
        (0.75, [2 / 3, 1 / 3, 0, 0]),
        (0.8, [4 / 7, 2 / 7, 1 / 7, 0]),
    ],
)
def test_top_p_boundary_on_unequal_probabilities(top_p, odds):
    """Probabilities 1/2, 1/4, 1/8, 1/8: the mass before each token is 0, 1/2, 3/4, 7/8."""
    logits = torch.log(torch.tensor([4.0, 2.0, 1.0, 1.0])).tolist()
    _exact_probs(logits, [0.5, 0.25, 0.125, 0.125])
    assert_frequencies(draws(logits, temperature=1.0, top_p=top_p), torch.tensor(odds))


def test_an_engines_seeded_requests_sample_from_the_models_softmax_over_the_temperature(models):
    """One prompt, 2,000 requests seeded 0..1999: their first tokens follow softmax(logits / 0.5)."""
    model = models["llama"]
    prompt = [5, 6, 7, 8]
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1].float()
    n = 2000
    engine = Engine(model, config=EngineConfig.model_validate({"backend": {"name": "eager"}}))
    params = [SamplingParams(max_new_tokens=1, temperature=0.5, seed=i) for i in range(n)]
    outs = engine.generate([prompt] * n, params)
    counts = Counter(o.output_token_ids[0] for o in outs)
    assert_frequencies(counts, torch.softmax(logits / 0.5, -1))
