"""The linear layers' alternative product order: same numbers, used only inside engine steps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cbcore import Engine, EngineConfig, SamplingParams
from cbcore.execution.linear import CALIBRATED_ROWS, LinearRouter, calibrate, transposed_linear
from cbcore.testing import tiny_model


@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("bias", [False, True])
def test_transposed_product_matches_f_linear(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(48, 32, generator=gen)
    b = torch.randn(48, generator=gen) if bias else None
    x = torch.randn(2, rows, 32, generator=gen)
    out = transposed_linear(x, w, b)
    assert out.shape == (2, rows, 48) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_routing_is_active_only_inside_engine_forwards():
    model = tiny_model("llama")
    engine = Engine(model, config=EngineConfig.model_validate({"execution": {"linear_layout": "transposed"}}))
    router = engine.runner.linear
    assert router.transposed_rows == frozenset(CALIBRATED_ROWS)
    seen: list[bool] = []
    probe = router.modules[0]
    hook = probe.register_forward_hook(lambda *_: seen.append(router.uses_transposed(1)))
    try:
        model(input_ids=torch.tensor([[5, 6, 7]]))  # plain HF use of the same model object
        engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=2))
    finally:
        hook.remove()
    assert seen[0] is False and all(seen[1:]) and len(seen) > 1


def test_one_router_per_model_and_layout_and_standard_unroutes():
    model = tiny_model("llama")
    first = LinearRouter.for_model(model, "transposed")
    assert LinearRouter.for_model(model, "transposed") is first
    assert all("forward" in m.__dict__ for m in first.modules)
    standard = LinearRouter.for_model(model, "standard")
    assert standard is not first and not standard.transposed_rows
    assert not any("forward" in m.__dict__ for m in standard.modules)


def test_calibration_returns_row_counts_it_measured():
    chosen = calibrate([torch.nn.Linear(64, 128), torch.nn.Linear(128, 64)], rounds=1)
    assert chosen <= set(CALIBRATED_ROWS)
