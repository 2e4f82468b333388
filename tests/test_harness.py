"""The equivalence harness has teeth: it catches broken attention and reports near-ties as such."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from support import CAPS, PROMPTS

import cbcore.backends.eager as eager
from cbcore import Engine, EngineConfig, SamplingParams
from cbcore.outputs import RequestOutput
from cbcore.testing import assert_equivalent, compare_greedy
from cbcore.testing.compare import compare_topk
from cbcore.testing.reference import ReferenceOutput


def leaky_mask(batch, window):  # forgets that sequences are separate
    return batch.positions[:, None] >= batch.kv_positions[None, :]


def windowless_mask(batch, window):  # forgets the sliding window
    same = batch.token_seq_index[:, None] == batch.kv_seq_index[None, :]
    return same & (batch.positions[:, None] >= batch.kv_positions[None, :])


@pytest.mark.parametrize(
    ("family", "broken"), [("llama", leaky_mask), ("gpt2", leaky_mask), ("mistral", windowless_mask)]
)
def test_broken_masks_are_caught(models, references, monkeypatch, family, broken):
    monkeypatch.setattr(eager, "block_diagonal_causal_mask", broken)
    engine = Engine(models[family], config=EngineConfig.model_validate({"backend": {"name": "eager"}}))
    outs = engine.generate(PROMPTS, [SamplingParams(max_new_tokens=c) for c in CAPS])
    report = compare_greedy(models[family], outs, references[family])
    assert report.num_diverged >= 8, report.table()
    with pytest.raises(AssertionError, match="DIVERGED"):
        assert_equivalent(report)


class FixedLogits(torch.nn.Module):
    """A stand-in model whose next-token logits are given."""

    def __init__(self, logits: list[float]) -> None:
        super().__init__()
        self.logits = torch.tensor(logits)
        self.dummy = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, attention_mask=None):
        return SimpleNamespace(logits=self.logits.expand(1, input_ids.shape[1], -1))


def _out(tokens: list[int], error: str | None = None) -> RequestOutput:
    return RequestOutput("r0", [1, 2], tokens, [], True, "length", error=error)


@pytest.mark.parametrize(("gap", "near"), [(5e-6, True), (2e-5, False)])
def test_near_tie_rule_is_exactly_one_e_minus_five(gap, near):
    model = FixedLogits([0.0, 1.0, 1.0 - gap, 0.5])
    report = compare_greedy(model, [_out([3, 2, 7])], [ReferenceOutput([3, 1, 4])])
    (c,) = report.comparisons
    assert (c.position, c.expected, c.actual) == (1, 1, 2)
    assert c.logit_gap == pytest.approx(gap, rel=1e-2)
    assert c.near_tie is near and report.ok is near
    assert ("near-tie (tolerated)" in report.table()) is near


def test_length_mismatch_and_engine_error_fail():
    model = FixedLogits([0.0, 1.0])
    report = compare_greedy(model, [_out([1, 1]), _out([], error="boom")], [ReferenceOutput([1, 1, 1])] * 2)
    assert not report.ok and report.num_diverged == 2
    assert "ended there" in report.comparisons[0].describe()
    assert "boom" in report.comparisons[1].describe()


def test_topk_rule():
    ref = ReferenceOutput([5, 6], top_logprobs=[{5: -0.1}, {6: -0.5, 9: -0.6}])
    close = RequestOutput("r", [1], [5, 9], [], True, "length", logprobs=[{5: -0.1}, {9: -0.5, 6: -0.6}])
    far = RequestOutput("r", [1], [5, 8], [], True, "length", logprobs=[{5: -0.1}, {8: -0.2}])
    assert compare_topk([close], [ref]).ok
    assert not compare_topk([far], [ref]).ok
    # the report's lines (what `cb check --dtype bfloat16` prints) name the rule: no logit gap here
    assert "near-tie (tolerated): first divergence at output token 1: expected 6, got 9, top-k rule" in (
        compare_topk([close], [ref]).table()
    )
    assert "DIVERGED: first divergence at output token 1: expected 6, got 8, top-k rule" in (
        compare_topk([far], [ref]).table()
    )
