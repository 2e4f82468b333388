"""The linear layers' oneDNN kind: used inside engine forwards only, refused by name where it cannot run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cbcore import Engine, EngineConfig, SamplingParams
from cbcore.execution.packed_linear import EXACT_ROWS, PAD_STEP, PIECE_ROWS, onednn_refusal, row_pieces
from cbcore.testing.tiny_models import random_prompts, tiny_model

pytestmark = pytest.mark.skipif(
    onednn_refusal([nn.Linear(2, 2)]) is not None, reason="this torch build has no oneDNN linear"
)


def _config(kind: str) -> EngineConfig:
    return EngineConfig.model_validate({"execution": {"linear": kind}})


def test_auto_packs_float32_linears_and_leaves_the_model_plain_outside_the_engine():
    model = tiny_model("llama")
    engine = Engine(model, config=_config("auto"))
    assert engine.runner.linear.kind == "onednn"
    layer = model.model.layers[0].mlp.gate_proj
    x = torch.randn(3, layer.in_features)
    # Outside an engine forward the layer is exactly F.linear (generate() and the HF baselines use it).
    assert torch.equal(layer(x), F.linear(x, layer.weight))
    with engine.runner.linear.active():
        routed = layer(x)
    assert routed.shape == (3, layer.out_features)
    assert torch.allclose(routed, F.linear(x, layer.weight), atol=1e-5)
    ids = random_prompts(2, 4, 12, seed=3)
    outs = engine.generate(ids, SamplingParams(max_new_tokens=5, ignore_eos=True))
    assert all(len(o.output_token_ids) == 5 for o in outs)


def test_any_row_count_reaches_onednn_as_one_of_few_shapes():
    """oneDNN caches a primitive per shape, megabytes each at a few hundred rows: a server seeing
    every row count must not grow one per count."""
    counts = set()
    for n in range(1, 5000):
        pieces = row_pieces(n)
        assert [a for a, _, _ in pieces] == list(range(0, n, PIECE_ROWS))  # the pieces tile the rows
        assert pieces[-1][1] == n
        for a, b, padded in pieces:
            assert b - a <= padded <= PIECE_ROWS and padded - (b - a) < PAD_STEP
            assert padded == b - a or padded > EXACT_ROWS  # the smallest products run unpadded
            counts.add(padded)
    assert len(counts) == EXACT_ROWS + (PIECE_ROWS - EXACT_ROWS) // PAD_STEP == 46


@pytest.mark.parametrize("rows", [1, 9, 128, 129, 256, 300, 520])
def test_padded_and_pieced_products_equal_the_plain_product(rows):
    model = tiny_model("llama")
    engine = Engine(model, config=_config("onednn"))
    layer = model.model.layers[0].mlp.down_proj
    x = torch.randn(rows, layer.in_features)
    with engine.runner.linear.active():
        routed = layer(x)
    assert routed.shape == (rows, layer.out_features) and routed.is_contiguous()
    assert torch.allclose(routed, F.linear(x, layer.weight), atol=1e-5)


def test_a_later_standard_engine_on_the_same_model_takes_the_routing_away():
    model = tiny_model("llama")
    Engine(model, config=_config("onednn"))
    assert any("forward" in m.__dict__ for m in model.modules() if type(m) is nn.Linear)
    engine = Engine(model, config=_config("standard"))
    assert engine.runner.linear.kind == "standard"
    assert not any("forward" in m.__dict__ for m in model.modules() if type(m) is nn.Linear)


def test_onednn_refuses_weights_it_cannot_pack_naming_them():
    model = tiny_model("llama", dtype=torch.float16)
    with pytest.raises(ValueError, match=r"execution.linear 'onednn' cannot run here: .*torch.float16"):
        Engine(model, config=_config("onednn"))
    assert Engine(model, config=_config("auto")).runner.linear.kind == "standard"  # auto: the plain product


def test_an_unknown_linear_kind_is_a_config_error():
    with pytest.raises(ValueError, match="linear"):
        _config("skinny")
