"""The sampler's contract where the distribution tests do not reach: zero log-probs, and one row failing alone.

``logprobs=0`` asks for no alternatives, only the chosen token's log-prob.
When sampling the batch raises (a row's logits are not numbers), each row is
sampled on its own from the generator state it had before: the good rows get
exactly the tokens they would get alone, the bad row alone gets an error.
"""

from __future__ import annotations

import math

import pytest
import torch

from cbcore.execution.sampler import sample, sample_each
from cbcore.scheduling.plan import RowPlan
from cbcore.scheduling.sampling_params import SamplingParams


def row(params: SamplingParams, seed: int | None = None) -> RowPlan:
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return RowPlan([1], 0, [0], params, generator)


def test_zero_logprobs_gives_the_chosen_tokens_log_prob_and_nothing_else() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    tokens, top = sample(logits, [row(SamplingParams(temperature=0.0, logprobs=0))])
    expected = torch.log_softmax(logits[0], dim=-1)[1].item()
    assert tokens == [1] and top[0].keys() == {1} and math.isclose(top[0][1], expected, rel_tol=1e-6)
    tokens, top = sample(logits, [row(SamplingParams(temperature=0.0, logprobs=2))])
    assert top[0].keys() == {1, 2}


def test_a_row_whose_sampling_fails_fails_alone_and_the_others_draw_what_they_would_alone() -> None:
    logits = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))
    logits[1] = float("nan")
    params = SamplingParams(temperature=0.8, top_p=0.9)
    rows = [row(params, seed=1), row(params, seed=2), row(params, seed=3)]
    states = [(r.generator, r.generator.get_state()) for r in rows]
    tokens, top, errors = sample_each(logits, rows, states)
    assert errors[0] is None and errors[2] is None
    assert errors[1] is not None and errors[1].startswith("sampling failed: RuntimeError")
    assert tokens[1] == -1 and top == [None, None, None]
    alone = [sample(logits[i : i + 1], [row(params, seed=i + 1)])[0][0] for i in (0, 2)]
    assert [tokens[0], tokens[2]] == alone


def test_a_batch_that_samples_reports_no_errors() -> None:
    logits = torch.randn(2, 16, generator=torch.Generator().manual_seed(1))
    rows = [row(SamplingParams(temperature=0.0)), row(SamplingParams(temperature=0.0))]
    tokens, _, errors = sample_each(logits, rows, [])
    assert tokens == logits.argmax(dim=-1).tolist() and errors == [None, None]


def test_only_the_rows_that_ask_for_logprobs_get_them() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 1.0, 2.0]])
    rows = [row(SamplingParams(temperature=0.0, logprobs=1)), row(SamplingParams(temperature=0.0))]
    tokens, top = sample(logits, rows)
    assert tokens == [1, 0] and top[0].keys() == {1} and top[1] is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_seeded_request_draws_on_cuda_what_it_draws_on_the_cpu() -> None:
    """The generators are CPU-side, so a request's tokens do not depend on the device its logits are on.

    Equal logits give probabilities that are exact on both devices (a quarter each), so the draws match.
    """
    params = SamplingParams(temperature=1.0)
    drawn = {}
    for device in ("cpu", "cuda"):
        seeded = row(params, seed=7)
        logits = torch.zeros(1, 4, device=device)
        drawn[device] = [sample(logits, [seeded])[0][0] for _ in range(32)]
    assert drawn["cuda"] == drawn["cpu"] and len(set(drawn["cpu"])) > 1
