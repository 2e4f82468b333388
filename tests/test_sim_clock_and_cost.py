"""The simulator's virtual clock never runs backwards, and its cost models price a step as written down here by hand."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import pytest
from pydantic import ValidationError

import cbcore.sim.suite as sim_suite
from cbcore.bench.generator import generate
from cbcore.scheduling.plan import RowPlan, StepPlan
from cbcore.scheduling.sampling_params import SamplingParams
from cbcore.serve.config import Settings
from cbcore.sim.executor import VirtualClock
from cbcore.sim.fitted import FitError, FittedCost
from cbcore.sim.model_shape import ModelShape
from cbcore.sim.profile import Identity, Profile, load_profile
from cbcore.sim.roofline import Hardware, RooflineCost, attention_coefficients
from cbcore.sim.shape import StepShape


class RecordingClock(VirtualClock):
    """A virtual clock that keeps every time it is read or moved to."""

    clocks: ClassVar[list[RecordingClock]] = []

    def __init__(self, now: float = 0.0) -> None:
        super().__init__(now)
        self.readings = [now]
        RecordingClock.clocks.append(self)

    def __call__(self) -> float:
        self.readings.append(self.now)
        return self.now

    def advance(self, seconds: float) -> None:
        super().advance(seconds)
        self.readings.append(self.now)

    def wait_until(self, when: float) -> None:
        super().wait_until(when)
        self.readings.append(self.now)


@pytest.mark.parametrize("replicas", [1, 3])
def test_the_virtual_clock_never_goes_back_over_a_whole_simulated_run(monkeypatch, replicas):
    """Arrivals that land while the last step of a busy spell runs wait for its end: time does not go back to them.

    Short requests arriving fast end many busy spells with an arrival inside their last step.
    """
    RecordingClock.clocks = []
    monkeypatch.setattr(sim_suite, "VirtualClock", RecordingClock)
    profile = load_profile("h200-llama-3-8b")
    workload = generate("poisson:n=200,rate=100,input_len=128,output_len=2,seed=2", profile.model.vocab_size)
    ids = [list(r.prompt_token_ids) for r in workload.requests]
    config = Settings.from_dict({}, ["scheduler.budget.max_num_seqs=8"])  # Settings: the replicas' router
    result = sim_suite.simulate_suite(profile, workload, ids, [("fcfs", config)], replicas=replicas)
    assert len(RecordingClock.clocks) == replicas
    for clock in RecordingClock.clocks:
        back = [(a, b) for a, b in zip(clock.readings, clock.readings[1:], strict=False) if b < a]
        assert not back, f"the clock went back {len(back)} times, first from {back[0][0]} to {back[0][1]}"
    assert result.rows[0]["completed"] == 200


def test_advancing_to_an_earlier_time_leaves_the_clock_where_it_is():
    clock = VirtualClock(5.0)
    clock.wait_until(3.0)
    assert clock() == 5.0
    clock.wait_until(7.5)
    assert clock() == 7.5
    with pytest.raises(ValueError, match="cannot go back"):
        clock.advance(-1.0)


# A made-up accelerator and model with round numbers, so that every term below is checkable by hand.
HW = Hardware(
    name="round",
    peak_flops=1e12,
    mem_bandwidth=1e9,
    flops_efficiency=0.5,
    bandwidth_efficiency=0.5,
    attn_flops_efficiency=0.25,
    host_bandwidth=1e8,
    step_overhead_s=1e-6,
    per_seq_overhead_s=1e-7,
)
MODEL = ModelShape(
    name="round",
    num_layers=2,
    hidden_size=8,
    intermediate_size=16,
    num_heads=2,
    num_kv_heads=1,
    head_dim=4,
    vocab_size=32,
)
IDENTITY = Identity(hardware="round", model="round", dtype="bfloat16", backend="x", source="roofline")


def a_step() -> StepPlan:
    """A prompt's first 3 of 5 tokens (from 0) and a decode at position 99 (its 100th token)."""
    prompt = RowPlan([0, 1, 2], 0, [0])  # not its last token: it samples nothing
    decode = RowPlan([7], 99, list(range(1, 8)), SamplingParams(), decode=True)  # one generated token, fed back
    return StepPlan([prompt, decode])


def test_a_steps_shape_counts_its_tokens_pairs_and_keys():
    shape = StepShape.of(a_step())
    # pairs: the prompt's 3 queries see 1 + 2 + 3 keys; the decode's query sees 100
    assert shape == StepShape(
        num_seqs=2, prefill_tokens=3, decode_tokens=1, attn_pairs=106, kv_tokens=103, sample_rows=(1,)
    )


def test_every_step_shape_is_the_per_row_sum_whatever_mix_of_rows():
    """The shape's fast paths (decode-only steps, decode rows summed at once) against the definition, row by row."""
    import random

    rng = random.Random(5)
    params = SamplingParams()
    for _ in range(500):
        rows = []
        for _ in range(rng.randint(0, 7)):
            start, kind = rng.randint(0, 60), rng.random()
            if kind < 0.5:
                rows.append(RowPlan([1], start, [], params, decode=True))
            else:  # a prefill chunk or a recomputation; its last chunk samples
                rows.append(RowPlan([1] * rng.randint(1, 9), start, [], params if kind < 0.75 else None))
        plan = StepPlan(rows, [(0, 1)] * rng.randint(0, 2), [(1, 0)] * rng.randint(0, 2))
        lens = [len(r.token_ids) for r in rows]
        assert StepShape.of(plan) == StepShape(
            num_seqs=len(rows),
            prefill_tokens=sum(n for r, n in zip(rows, lens, strict=True) if not r.decode),
            decode_tokens=sum(r.decode for r in rows),
            attn_pairs=sum(n * r.start + n * (n + 1) // 2 for r, n in zip(rows, lens, strict=True)),
            kv_tokens=sum(r.start + n for r, n in zip(rows, lens, strict=True)),
            sample_rows=tuple(i for i, r in enumerate(rows) if r.params is not None),
            swap_blocks=len(plan.swap_in) + len(plan.swap_out),
        ), plan


def test_the_roofline_prices_a_step_as_computed_by_hand():
    """bfloat16 (2 bytes), 4 tokens, 1 sampled row, 2 layers; every number below is worked out by hand."""
    shape = StepShape.of(a_step())
    flop_s, byte_s = 1e12 * 0.5, 1e9 * 0.5
    # Per layer, the four products (in x out): qkv 8 x 16 (2 query + 2x1 KV heads of 4), o 8 x 8,
    # gate+up 8 x 32, down 16 x 8. FLOPs 2 * tokens * in * out; bytes (in*out + tokens*(in+out)) * 2.
    flops = 2 * 4 * (8 * 16 + 8 * 8 + 8 * 32 + 16 * 8)  # 4,608
    moved = 2 * ((128 + 4 * 24) + (64 + 4 * 16) + (256 + 4 * 40) + (128 + 4 * 24))  # 1,984
    linear = 2 * (flops / flop_s + moved / byte_s)
    # Attention per layer: 4 * pairs * heads * head_dim FLOPs at a quarter of peak, or reading
    # K and V of every key (2 halves x 1 KV head x 4 x 2 bytes) and the queries in and out
    # (2 x tokens x 2 heads x 4 x 2 bytes), whichever takes longer: here the reading.
    kv_bytes = 103 * 2 * 1 * 4 * 2  # 1,648
    q_bytes = 2 * 4 * 2 * 4 * 2  # 128
    assert (kv_bytes + q_bytes) / byte_s > 4 * 106 * 2 * 4 / (1e12 * 0.25)
    attention = 2 * (kv_bytes + q_bytes) / byte_s
    # Norms, rotary, residuals: 10 passes over the hidden vector and 3 over the MLP's, read and written.
    elementwise = 2 * (2 * 4 * (10 * 8 + 3 * 16) * 2) / byte_s
    head = (2 * 1 * 8 * 32) / flop_s + ((8 * 32 + 1 * (8 + 32)) * 2) / byte_s  # one sampled row
    overhead = 1e-6 + 2 * 1e-7
    expected = linear + attention + elementwise + head + overhead
    profile = Profile(identity=IDENTITY, model=MODEL, cost=RooflineCost(hardware=HW))
    assert profile.step_time(shape, 16) == pytest.approx(expected, rel=1e-12)


def test_each_key_read_costs_both_its_k_and_its_v():
    """One more cached key in a memory-bound step costs K and V of every layer: 2 x 2 layers x 4 dims x 2 bytes."""
    cost = RooflineCost(hardware=HW)
    shape = StepShape.of(a_step())
    one_more = StepShape(
        num_seqs=2, prefill_tokens=3, decode_tokens=1, attn_pairs=106, kv_tokens=104, sample_rows=(1,)
    )
    extra = cost.step_time(one_more, MODEL, 2, 16) - cost.step_time(shape, MODEL, 2, 16)
    assert extra == pytest.approx(2 * (2 * 1 * 4 * 2) / (1e9 * 0.5), rel=1e-6)


def test_swapped_blocks_cost_their_k_and_v_over_the_host_link():
    cost = RooflineCost(hardware=HW)
    shape = StepShape.of(a_step())
    swapping = StepShape(
        num_seqs=2,
        prefill_tokens=3,
        decode_tokens=1,
        attn_pairs=106,
        kv_tokens=103,
        sample_rows=(1,),
        swap_blocks=3,
    )
    extra = cost.step_time(swapping, MODEL, 2, 16) - cost.step_time(shape, MODEL, 2, 16)
    # 3 blocks x 16 tokens x (K and V x 2 layers x 1 KV head x 4 dims x 2 bytes) over 1e8 bytes/s
    assert extra == pytest.approx(3 * 16 * (2 * 2 * 1 * 4 * 2) / 1e8, rel=1e-9)


def test_the_fitted_model_prices_a_step_as_computed_by_hand():
    fit = FitError(num_steps=1, mean_abs=0.0, p90_abs=0.0, max_abs=0.0)
    cost = FittedCost(
        knots=[1, 8, 32],
        knot_s=[0.010, 0.024, 0.040],
        per_attn_pair_s=1e-6,
        per_kv_token_s=2e-6,
        per_sample_s=3e-4,
        per_seq_s=5e-4,
        fit=fit,
    )
    shape = StepShape.of(a_step())
    # 4 tokens lie 3/7 of the way from the knot at 1 to the knot at 8
    g = 0.010 + (0.024 - 0.010) * 3 / 7
    expected = g + 106 * 1e-6 + 103 * 2e-6 + 1 * 3e-4 + 2 * 5e-4
    profile = Profile(identity=IDENTITY, model=MODEL, cost=cost)
    assert profile.step_time(shape, 16) == pytest.approx(expected, rel=1e-12)
    wide = StepShape(
        num_seqs=1, prefill_tokens=64, decode_tokens=0, attn_pairs=0, kv_tokens=0, sample_rows=()
    )
    assert cost.step_time(wide) == pytest.approx(
        0.040 * 64 / 32 + 5e-4, rel=1e-12
    )  # past the last knot: in proportion


# A grouped-query model: 8 query heads sharing 2 K/V heads of 4 dims, in one layer.
GQA = MODEL.model_copy(update={"name": "gqa", "num_layers": 1, "hidden_size": 32, "num_heads": 8, "num_kv_heads": 2})


def test_attention_costs_per_pair_per_key_and_per_query_as_computed_by_hand():
    """4 * heads * head_dim FLOPs per query-key pair at the attention share of peak; K and V of every
    K/V head per key, and the query in and its output out per query token, at the achieved bandwidth."""
    per_pair, per_key, per_query = attention_coefficients(HW, GQA, 2)
    assert per_pair == pytest.approx(4 * 8 * 4 / (1e12 * 0.25), rel=1e-12)
    assert per_key == pytest.approx(2 * 2 * 4 * 2 / (1e9 * 0.5), rel=1e-12)
    assert per_query == pytest.approx(2 * 8 * 4 * 2 / (1e9 * 0.5), rel=1e-12)


@pytest.mark.parametrize(
    ("tp", "heads", "kv_heads"),
    [(1, 8, 2), (2, 4, 1), (4, 2, 1), (8, 1, 1)],  # fewer K/V heads than GPUs: each GPU holds one
)
def test_tensor_parallelism_splits_the_query_heads_and_the_kv_heads_it_can(tp, heads, kv_heads):
    per_pair, per_key, per_query = attention_coefficients(HW, GQA, 2, tp)
    assert per_pair == pytest.approx(4 * heads * 4 / (1e12 * 0.25), rel=1e-12)
    assert per_key == pytest.approx(2 * kv_heads * 4 * 2 / (1e9 * 0.5), rel=1e-12)
    assert per_query == pytest.approx(2 * heads * 4 * 2 / (1e9 * 0.5), rel=1e-12)


def test_a_compute_bound_attention_costs_its_pairs():
    """Many pairs over few keys (a long prompt chunk at once): the FLOPs, not the reads, set the time."""
    cost = RooflineCost(hardware=HW)
    base = StepShape(num_seqs=1, prefill_tokens=4, decode_tokens=0, attn_pairs=10**6, kv_tokens=4, sample_rows=())
    more = dataclasses.replace(base, attn_pairs=10**6 + 1000)
    extra = cost.step_time(more, GQA, 2, 16) - cost.step_time(base, GQA, 2, 16)
    assert extra == pytest.approx(1000 * 4 * 8 * 4 / (1e12 * 0.25), rel=1e-6)  # one layer


def test_a_cost_model_cannot_be_changed_once_built():
    cost = RooflineCost(hardware=HW)
    with pytest.raises(ValidationError, match="frozen"):
        cost.hardware = HW.model_copy(update={"peak_flops": 2e12})
    with pytest.raises(ValidationError, match="frozen"):
        HW.peak_flops = 2e12
