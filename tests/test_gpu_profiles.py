"""Measured GPU profiles: Vidur's operator tables interpolated, the all-reduce, KV capacity, the held-out check."""

from __future__ import annotations

import math
from itertools import pairwise

import numpy as np
import pytest

from cbcore.bench.sources import load_workload
from cbcore.cli.main import main
from cbcore.config import EngineConfig
from cbcore.sim.anchor import fit_efficiencies
from cbcore.sim.executor import sim_num_blocks
from cbcore.sim.gpu import catalog, tables
from cbcore.sim.gpu.check import (
    LAYER_MAX_BOUND,
    LAYER_MEAN_BOUND,
    ROOFLINE_EFFICIENCIES,
    check,
    check_all,
    roofline_hardware,
)
from cbcore.sim.gpu.cost import MeasuredCost
from cbcore.sim.profile import Profile, ProfileError, load_profile
from cbcore.sim.shape import StepShape
from cbcore.sim.suite import simulate_suite

GIB = 2**30


def step(tokens: int, samples: int = 0, keys: int = 0, pairs: int = 0, swaps: int = 0) -> StepShape:
    return StepShape(num_seqs=max(samples, 1), prefill_tokens=tokens - samples, decode_tokens=samples,
                     attn_pairs=pairs, kv_tokens=keys, sample_rows=tuple(range(samples)), swap_blocks=swaps)  # fmt: skip


def raw(gpu: str, model: str, tp: int) -> tuple[list[int], dict[str, list[float]]]:
    """The shipped table as stored (ms), read without the interpolation code."""
    table = tables._data()["compute"][f"{gpu}/{model}"][str(tp)]
    return table["tokens"], table["ops"]


def test_every_measured_profile_loads_prices_a_step_and_states_its_attention() -> None:
    specs = catalog.all_specs()
    assert len(specs) == 56  # 20 tables; A40 at TP > 1 is refused, phi-2 has TP 1 only
    for spec in specs:
        profile = load_profile(spec.name)
        assert profile.identity.source == "measured" and profile.identity.dtype == "float16"
        assert profile.model == catalog.MODELS[spec.model].shape
        decode = profile.step_time(step(8, samples=8, keys=8 * 500, pairs=8 * 500), 16)
        assert 0 < decode < 1
        assert profile.describe()["attention"].startswith("roofline, not validated")


def test_interpolation_reproduces_every_table_row_exactly() -> None:
    for gpu, model, tp in (("a100", "llama-2-7b", 1), ("h100", "qwen-72b", 4), ("a100", "llama-3-8b", 2),
                           ("a40", "phi-2", 1)):  # fmt: skip
        tokens, ops = raw(gpu, model, tp)
        curves = tables.operator_curves(gpu, model, tp)
        assert set(curves) == set(ops)
        for op, ms in ops.items():
            want = [v / 1000 for v in ms]
            assert [curves[op].at(t) for t in tokens] == pytest.approx(want, rel=1e-12)
            assert curves[op].over(np.array(tokens)).tolist() == pytest.approx(want, rel=1e-12)


def test_a_step_at_a_measured_token_count_costs_the_tables_sum() -> None:
    """TP 1: embedding once plus every layer's operators; no all-reduce, no LM head; of attention only
    the queries' own traffic (no keys)."""
    tokens, ops = raw("a100", "llama-2-7b", 1)
    pricer = load_profile("a100-llama-2-7b-tp1").cost.pricer(16)  # type: ignore[union-attr]
    for i in (0, 5, 100, len(tokens) - 1):
        layer = sum(ms[i] for op, ms in ops.items() if op != "emb")
        measured = pricer(step(tokens[i])) - tokens[i] * pricer.per_query
        assert measured == pytest.approx((ops["emb"][i] + 32 * layer) / 1000, rel=1e-12)
    assert pricer.extrapolated == 0


def test_matrix_products_step_up_to_the_next_measured_count_and_the_rest_is_linear() -> None:
    curves = tables.operator_curves("a100", "llama-2-7b", 1)
    qkv, norm = curves["attn_pre_proj"], curves["input_layernorm"]
    assert qkv.step and not norm.step
    assert qkv.at(129) == qkv.at(136) and qkv.at(3) == qkv.at(4)
    assert norm.at(132) == pytest.approx((norm.at(128) + norm.at(136)) / 2)


@pytest.mark.parametrize("op", tables.LAYER_OPS)
def test_curves_are_monotone_wherever_the_measurements_are(op: str) -> None:
    curve = tables.operator_curves("h100", "llama-2-70b", 2).get(op)
    assert curve is not None
    xs = np.arange(1, int(curve.top) + 1)
    ys = curve.over(xs)
    checked = 0
    for (x0, y0), (x1, y1) in pairwise(zip(curve.x, curve.y, strict=True)):
        inside = ys[(xs >= x0) & (xs <= x1)]
        if y1 >= y0:
            assert (np.diff(inside) >= 0).all() and inside.min() >= y0 and inside.max() <= y1
            checked += 1
    assert checked > 100


def test_steps_beyond_the_tables_are_extrapolated_in_proportion_and_counted() -> None:
    pricer = load_profile("a100-llama-2-7b-tp1").cost.pricer(16)  # type: ignore[union-attr]
    at_top = pricer(step(4096))
    assert pricer.extrapolated == 0
    assert pricer(step(8192)) == pytest.approx(2 * at_top, rel=1e-12)
    assert pricer(step(6000)) == pytest.approx(at_top * 6000 / 4096, rel=1e-12)
    assert pricer.extrapolated == 2
    # Llama-3-70B at TP 8: compute is measured to 32,768 tokens, the DGX all-reduce to 64 MiB = 4,096 tokens
    # of 8,192 float16 activations; wider steps are counted although the compute is inside its table.
    wide = load_profile("a100-llama-3-70b-tp8")
    assert wide.describe()["exact_up_to_tokens"] == 4096
    pricer = wide.cost.pricer(16)  # type: ignore[union-attr]
    pricer(step(4096))
    assert pricer.extrapolated == 0
    pricer(step(5000))
    assert pricer.extrapolated == 1


def test_a_simulated_run_reports_its_extrapolated_steps(capsys: pytest.CaptureFixture[str]) -> None:
    profile = load_profile("a100-llama-2-7b-tp1")
    workload = load_workload(
        "poisson:n=6,rate=inf,lengths=uniform,input_len=3000,output_len=3,range_ratio=0.9,max_input=3500,seed=1",
        profile.model.vocab_size,
    )
    wide = EngineConfig.model_validate({"scheduler": {
        "prefill": {"name": "whole-prompt"},
        "budget": {"name": "token-budget", "max_num_seqs": 8, "max_num_batched_tokens": 8192},
    }})  # fmt: skip
    narrow = EngineConfig.model_validate({"scheduler": {"budget": {"name": "token-budget", "max_num_seqs": 8,
                                                                   "max_num_batched_tokens": 4096}}})  # fmt: skip
    ids = [list(r.prompt_token_ids) for r in workload.requests]
    result = simulate_suite(profile, workload, ids, [("wide", wide), ("narrow", narrow)])
    rows = {r["name"]: r for r in result.rows}
    assert rows["wide"]["extrapolated_steps"] >= 2  # prompts of ~3,000 tokens two at a time
    assert rows["narrow"]["extrapolated_steps"] == 0
    assert main(["simulate", "--profile", "a100-llama-2-7b-tp1", "--no-progress", "--workload",
                 "poisson:n=4,rate=inf,lengths=uniform,input_len=3000,output_len=2,range_ratio=0.9,max_input=3500,seed=1",
                 "--set", "scheduler.prefill.name=whole-prompt",
                 "--set", "scheduler.budget.max_num_batched_tokens=8192"]) == 0  # fmt: skip
    err = capsys.readouterr().err
    assert "steps were wider than the profile's measured tables (4096 tokens)" in err and "in proportion" in err


def test_the_all_reduce_is_added_above_tp1_and_absent_at_tp1() -> None:
    for tp in (1, 2, 4):
        tokens, ops = raw("a100", "llama-2-7b", tp)
        pricer = load_profile(f"a100-llama-2-7b-tp{tp}").cost.pricer(16)  # type: ignore[union-attr]
        for i in (3, 60, 200):
            compute = (ops["emb"][i] + 32 * sum(ms[i] for op, ms in ops.items() if op != "emb")) / 1000
            network = pricer(step(tokens[i])) - tokens[i] * pricer.per_query - compute
            if tp == 1:
                assert network == pytest.approx(0, abs=1e-12)
            else:  # two per layer, each of the step's activations: tokens x 4,096 x 2 bytes
                one = tables.allreduce_curve("a100_dgx", tp).at(tokens[i] * 4096 * 2)
                assert network == pytest.approx(2 * 32 * one, rel=1e-9) and one > 0
    nvlink = load_profile("vidur:gpu=h100,model=llama-2-70b,tp=4,network=pairwise-nvlink")
    dgx = load_profile("h100-llama-2-70b-tp4")
    assert nvlink.step_time(step(512), 16) != dgx.step_time(step(512), 16)
    assert "h100_pairwise_nvlink" in nvlink.describe()["network"]


def test_kv_capacity_is_the_gpu_memory_left_by_the_weights_worked_by_hand() -> None:
    # Llama-2-7B: 6,738,415,616 parameters (its HF checkpoint's count), float16.
    assert catalog.MODELS["llama-2-7b"].params_per_gpu(1) == 6_738_415_616
    assert catalog.MODELS["phi-2"].params_per_gpu(1) == 2_779_683_840  # biases and LayerNorms included
    profile = load_profile("a100-llama-2-7b-tp1")
    usable = 0.9 * 80 * GIB  # A100-SXM4-80GB at vLLM's default utilisation
    kv_bytes = usable - 2 * 6_738_415_616
    per_token = 2 * 32 * 32 * 128 * 2  # K and V x layers x KV heads x head dim x 2 bytes = 512 KiB
    assert profile.kv_capacity_tokens() == math.floor(kv_bytes / per_token) == 121_750
    assert sim_num_blocks(EngineConfig(), profile) == 121_750 // 16
    # The config's own sizing wins.
    assert sim_num_blocks(EngineConfig.model_validate({"kv_cache": {"num_blocks": 100}}), profile) == 100
    # Llama-2-70B at TP 4: a quarter of the sharded weights per GPU, 2 of the 8 KV heads per GPU.
    seventy = load_profile("a100-llama-2-70b-tp4")
    weights = catalog.MODELS["llama-2-70b"].params_per_gpu(4) * 2
    assert weights / GIB == pytest.approx(68.98e9 * 2 / 4 / GIB, rel=0.01)
    assert seventy.kv_capacity_tokens() == math.floor((usable - weights) / (2 * 80 * 2 * 128 * 2))
    with pytest.raises(ValueError, match="do not fit"):
        load_profile("a100-llama-2-70b-tp1").kv_capacity_tokens()
    assert load_profile("vidur:gpu=a100,model=llama-2-7b,util=0.5").kv_capacity_tokens() < 121_750


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("a40-llama-2-7b-tp2", "no all-reduce measurement for the A40"),
        ("vidur:gpu=a40,model=qwen-72b,tp=8", "no all-reduce measurement"),
        ("h100-llama-3-8b-tp1", "measured it on a100 only"),
        ("a100-phi-2-tp2", "measured at TP 1 only"),
        ("a100-llama-2-7b-tp3", "not 3"),
        ("vidur:gpu=a100,model=llama-2-7b,tp=8,network=pairwise-nvlink", "2, 4 workers only"),
        ("a100-llama2-7b", "did you mean 'llama-2-7b'"),
        ("vidur:gpu=b200,model=llama-2-7b", "no measured tables"),
        ("vidur:model=llama-2-7b", "gpu missing"),
        ("vidur:gpu=a100,model=llama-2-7b,util=1.5", "util=1.5"),
    ],
)
def test_what_the_tables_do_not_cover_is_refused_by_name(name: str, message: str) -> None:
    with pytest.raises(ProfileError, match=message):
        load_profile(name)


def test_names_and_the_shipped_data_agree() -> None:
    assert {k: tuple(v) for k, v in tables.measured().items()} == catalog.MEASURED
    assert {k: tuple(v) for k, v in tables.clusters().items()} == catalog.NETWORK_WORKERS
    assert load_profile("a100-llama-2-7b") == load_profile("a100-llama-2-7b-tp1")  # TP 1 by default
    assert load_profile("h100-llama-2-7b").identity.source == "measured"  # the roofline it replaces is gone
    assert load_profile("h200-llama-3-8b").identity.source == "roofline"  # no H200 table: kept


def test_a_measured_profile_round_trips_as_a_file_and_its_model_is_checked(tmp_path) -> None:
    profile = load_profile("vidur:gpu=h100,model=qwen-72b,tp=8,util=0.85")
    path = tmp_path / "p.json"
    profile.save(path)
    again = load_profile(path)
    assert again == profile and again.step_time(step(300), 16) == profile.step_time(step(300), 16)
    longer = profile.model.model_copy(update={"max_position_embeddings": 65536})
    Profile(identity=profile.identity, model=longer, cost=profile.cost)  # the context may differ
    other = profile.model.model_copy(update={"num_layers": 2})
    with pytest.raises(ValueError, match="tables price"):
        Profile(identity=profile.identity, model=other, cost=profile.cost)


def test_attention_and_lm_head_follow_their_stated_models() -> None:
    cost = load_profile("a100-llama-3-8b-tp1").cost
    assert isinstance(cost, MeasuredCost)
    pricer = cost.pricer(16)
    bare = pricer(step(64))
    measured = load_profile("a100-llama-3-8b-tp1").cost.arrays().base[64]  # type: ignore[union-attr]
    query = 32 * 64 * 32 * 128 * 2 * 2 / (2.039e12 * 0.78)  # layers x rows x heads x dim x (in, out) x 2 bytes
    assert bare - measured == pytest.approx(query, rel=1e-9)
    # 64 decode rows at 2,000 keys each: memory-bound, 8 KV heads x 128 x 2 (K, V) x 2 bytes per key and layer.
    decode = pricer(step(64, keys=64 * 2000, pairs=64 * 2000))
    assert decode - bare == pytest.approx(32 * 64 * 2000 * 8 * 128 * 2 * 2 / (2.039e12 * 0.78), rel=1e-9)
    # A 2,000-token prompt: compute-bound, 4 FLOPs x 32 heads x 128 per query-key pair at half of 312 TFLOP/s.
    pairs = 2000 * 2001 // 2
    prompt = pricer(step(2000, keys=2000, pairs=pairs)) - pricer(step(2000))
    assert prompt == pytest.approx(32 * pairs * 4 * 32 * 128 / (0.5 * 312e12) - 32 * 2000 * 32 * 128 * 4 / (2.039e12 * 0.78),
                                   rel=1e-9)  # fmt: skip
    # The LM head: the up-projection at the sampled rows x vocab / (2 x intermediate).
    up = tables.operator_curves("a100", "llama-3-8b", 1)["mlp_up_proj"]
    assert pricer(step(64, samples=64)) - bare == pytest.approx(up.at(64) * 128256 / (2 * 14336), rel=1e-9)
    # Swaps: a block's K/V (16 tokens x 128 KiB) over the host link.
    assert pricer(step(64, swaps=10)) - bare == pytest.approx(10 * 16 * 131072 / 25e9, rel=1e-9)


def test_the_held_out_check_stays_within_its_bound_for_every_profile() -> None:
    rows = check_all()
    assert len(rows) == len(catalog.all_specs())
    for row in rows:
        assert row.layer_mean <= LAYER_MEAN_BOUND, row
        assert row.layer_max <= LAYER_MAX_BOUND, row
        assert row.held_out == len(tables.held_out(row.rows)) > row.rows // 5
    # The roofline column is the figure docs/simulate.md gives for the shipped H100 roofline (5.2 %).
    assert check(catalog.Spec("h100", "llama-2-7b")).roofline_linear_mean == pytest.approx(0.052, abs=0.001)


def test_a_broken_interpolation_fails_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check measures the interpolation itself: nearest-lower values instead of the curve fail it."""
    real = tables.Curve.over

    def lower(self: tables.Curve, x: np.ndarray) -> np.ndarray:
        i = np.maximum(np.searchsorted(self.x, np.asarray(x), side="right") - 1, 0)
        return np.asarray(self.y)[i] * 0.9

    monkeypatch.setattr(tables.Curve, "over", lower)
    row = check(catalog.Spec("a100", "llama-2-7b"))
    monkeypatch.setattr(tables.Curve, "over", real)
    assert row.layer_mean > LAYER_MEAN_BOUND


@pytest.mark.parametrize("gpu", sorted(ROOFLINE_EFFICIENCIES))
def test_the_roofline_efficiencies_are_those_its_table_fits(gpu: str) -> None:
    tokens, ops = raw(gpu, "llama-2-7b", 1)
    timings = [(t, sum(ops[op][i] for op in tables.LINEAR_OPS) / 1000) for i, t in enumerate(tokens)]
    hw = fit_efficiencies(roofline_hardware(gpu), catalog.MODELS["llama-2-7b"].shape, timings)
    assert (hw.flops_efficiency, hw.bandwidth_efficiency) == ROOFLINE_EFFICIENCIES[gpu]


@pytest.mark.parametrize("gpu", sorted(catalog.GPUS))
def test_attention_reads_at_the_bandwidth_the_tables_show(gpu: str) -> None:
    """One token through Llama-2-70B's four linear products at TP 1 reads their weights once."""
    _, ops = raw(gpu, "llama-2-70b", 1)
    shape = catalog.MODELS["llama-2-70b"].shape
    weights = sum(i * o for i, o in shape.linear_layers()) * 2
    seconds = sum(ops[op][0] for op in tables.LINEAR_OPS) / 1000
    g = catalog.GPUS[gpu]
    assert weights / seconds / g.mem_bandwidth == pytest.approx(g.achieved_bandwidth, abs=0.01)


def test_cli_lists_the_profiles_and_prints_the_check(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    text = capsys.readouterr().out
    assert "a100-llama-2-7b-tp{1,2,4,8}" in text and "a40-llama-2-7b-tp1" in text and "h200-llama-3-8b" in text
    assert main(["profile", "--check", "a100-llama-2-7b-tp1", "h100-qwen-72b-tp2"]) == 0
    out = capsys.readouterr().out
    assert "| `a100-llama-2-7b-tp1` | 259 / 64 |" in out and "`h100-qwen-72b-tp2`" in out
    assert main(["profile", "--check", "a40-llama-2-7b-tp4"]) == 2
    assert "no all-reduce" in capsys.readouterr().err
