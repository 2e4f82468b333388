"""The linear layers' alternative product order: same numbers, used only inside engine steps."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from cbcore import Engine, EngineConfig, SamplingParams
from cbcore.execution import linear, skinny_linear
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
    assert router.orders == dict.fromkeys(CALIBRATED_ROWS, "transposed")
    seen: list[bool] = []
    probe = router.modules[0]
    hook = probe.register_forward_hook(lambda *_: seen.append(router.order_for(1) == "transposed"))
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
    assert standard is not first and not standard.orders
    assert not any("forward" in m.__dict__ for m in standard.modules)


def test_calibration_returns_row_counts_it_measured_and_orders_it_timed():
    chosen = calibrate([torch.nn.Linear(64, 128), torch.nn.Linear(128, 64)], ("transposed", "skinny"), rounds=1)
    assert set(chosen) <= set(CALIBRATED_ROWS) and set(chosen.values()) <= {"transposed", "skinny"}
    with pytest.raises(ValueError, match="unknown linear orders"):
        calibrate([torch.nn.Linear(4, 4)], ("sideways",), rounds=1)


def test_a_row_count_between_calibrated_ones_takes_the_larger_ones_choice(cache_dir, monkeypatch):
    monkeypatch.setattr(linear, "calibrate", lambda modules, candidates, rounds=5: {2: "transposed", 8: "skinny"})
    router = LinearRouter(tiny_model("llama"), "auto")
    with router.active():
        orders = [router.order_for(rows) for rows in (1, 2, 3, 7, 8, 9, 500)]
    assert orders == ["standard", "transposed", "standard", "skinny", "skinny", "standard", "standard"]
    assert router.order_for(2) == "standard"  # outside an engine forward


@pytest.mark.parametrize("layout", ["transposed", "skinny"])
def test_every_routed_order_gives_the_standard_tokens(layout):
    model = tiny_model("llama")
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [3]]
    params = SamplingParams(max_new_tokens=6)
    cfg = {"execution": {"linear_layout": "standard"}}
    want = [o.output_token_ids for o in Engine(model, config=EngineConfig.model_validate(cfg)).generate(prompts, params)]
    engine = Engine(model, config=EngineConfig.model_validate({"execution": {"linear_layout": layout}}))
    assert set(engine.runner.linear.orders.values()) == {layout}
    assert [o.output_token_ids for o in engine.generate(prompts, params)] == want


def test_skinny_refuses_weights_it_cannot_multiply():
    model = tiny_model("llama").to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"'skinny' cannot run here: .*float32 weights only.*bfloat16"):
        LinearRouter(model, "skinny")


def test_without_a_compiler_auto_times_the_blas_orders_only(cache_dir, monkeypatch, caplog):
    monkeypatch.setenv("CC", "no-such-cc")
    skinny_linear.KERNEL.forget()
    timed: list[tuple] = []
    monkeypatch.setattr(linear, "calibrate", lambda modules, candidates, rounds=5: timed.append(candidates) or {})
    try:
        LinearRouter(tiny_model("llama"), "auto")
        with pytest.raises(ValueError, match="'skinny' cannot run here: no C compiler found"):
            LinearRouter(tiny_model("llama"), "skinny")
    finally:
        skinny_linear.KERNEL.forget()
    assert timed == [("transposed",)]
    assert "skinny linear kernel unavailable" in caplog.text


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CBCORE_CACHE_DIR", str(tmp_path))
    return tmp_path


@pytest.fixture
def measured(monkeypatch):
    """Stands in for the timing: each calibration returns the next of these choices."""
    choices = [{2: "skinny", 3: "transposed"}, {4: "skinny"}, {5: "transposed"}]
    calls: list[dict[int, str]] = []

    def fake(modules, candidates, rounds=5):
        calls.append(choices[len(calls)])
        return calls[-1]

    monkeypatch.setattr(linear, "calibrate", fake)
    return calls


def test_a_calibration_is_remembered_per_machine_model_and_threads(cache_dir, measured):
    first = LinearRouter(tiny_model("llama"), "auto")
    assert (first.orders, first.source) == ({2: "skinny", 3: "transposed"}, "measured")
    again = LinearRouter(tiny_model("llama"), "auto")  # another model object of the same shape: a later process
    assert (again.orders, again.source) == ({2: "skinny", 3: "transposed"}, "cached") and len(measured) == 1
    other_shape = LinearRouter(tiny_model("gpt2"), "auto")
    assert other_shape.source == "measured" and len(measured) == 2
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert LinearRouter(tiny_model("llama"), "auto").source == "measured"
    finally:
        torch.set_num_threads(threads)
    assert len(measured) == 3
    entries = json.loads((cache_dir / "linear-order.json").read_text())["entries"]
    stored = sorted(json.dumps(v["orders"], sort_keys=True) for v in entries.values())
    assert stored == ['{"2": "skinny", "3": "transposed"}', '{"4": "skinny"}', '{"5": "transposed"}']


def test_fresh_calibration_measures_again_and_replaces_the_remembered_choice(cache_dir, measured):
    LinearRouter(tiny_model("llama"), "auto")  # an earlier process measured {2: skinny, 3: transposed}
    model = tiny_model("llama")
    cached = LinearRouter.for_model(model, "auto")
    assert (cached.orders, cached.source) == ({2: "skinny", 3: "transposed"}, "cached")
    fresh = LinearRouter.for_model(model, "auto", "fresh")
    assert (fresh.orders, fresh.source, len(measured)) == ({4: "skinny"}, "measured", 2)
    assert LinearRouter.for_model(model, "auto", "fresh") is fresh  # measured in this process already
    assert LinearRouter.for_model(model, "auto") is fresh
    later = LinearRouter(tiny_model("llama"), "auto")
    assert (later.orders, later.source) == ({4: "skinny"}, "cached")


def test_an_unreadable_cache_is_measured_over_and_an_unwritable_one_is_only_slower(cache_dir, measured, tmp_path):
    (cache_dir / "linear-order.json").write_text("{not json")
    router = LinearRouter(tiny_model("llama"), "auto")
    assert (router.orders, router.source) == ({2: "skinny", 3: "transposed"}, "measured")
    assert json.loads((cache_dir / "linear-order.json").read_text())["entries"]  # rewritten whole
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    os.environ["CBCORE_CACHE_DIR"] = str(blocker / "cache")  # cannot be created: a file is in the way
    router = LinearRouter(tiny_model("llama"), "auto")
    assert (router.orders, router.source) == ({4: "skinny"}, "measured")


def test_the_engine_config_selects_a_fresh_calibration(cache_dir, measured):
    cfg = {"execution": {"linear_calibration": "fresh"}}
    Engine(tiny_model("llama"), config=EngineConfig())
    engine = Engine(tiny_model("llama"), config=EngineConfig.model_validate(cfg))
    assert engine.runner.linear.orders == {4: "skinny"} and len(measured) == 2
    with pytest.raises(ValueError, match="linear_calibration"):
        EngineConfig.model_validate({"execution": {"linear_calibration": "sometimes"}})
