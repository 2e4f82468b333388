"""Simulation: the engine's own scheduler and bookkeeping on a virtual clock, priced by a cost model."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence as Seq
from pathlib import Path

import pytest
from test_plugins import SERIAL_SCHEDULER, write

from cbcore.bench.driver import VirtualClock, drive, warm_up
from cbcore.bench.generator import generate
from cbcore.bench.stepcost import timed_steps
from cbcore.bench.workload import BenchRequest, Workload
from cbcore.cli.main import main
from cbcore.config import EngineConfig
from cbcore.engine import Engine
from cbcore.engine_core import EngineCore, StepRecord
from cbcore.sim.anchor import LLAMA_2_7B, check_linear, load_linear
from cbcore.sim.executor import sim_engine
from cbcore.sim.fitted import fit_cost, nnls, refit
from cbcore.sim.gpu.check import roofline_hardware
from cbcore.sim.model_shape import ModelShape
from cbcore.sim.profile import Identity, Profile, ProfileError, load_profile
from cbcore.sim.profiler import QUICK, make_profile, profile_config
from cbcore.sim.shape import StepShape
from cbcore.sim.suite import simulate_suite
from cbcore.testing.block_invariants import check_blocks

DATA = Path(__file__).parent / "data"
# Lengths differ per request, all arrive at t=0: the schedule then depends on no clock.
BATCH = "poisson:n=12,rate=inf,lengths=uniform,input_len=24,output_len=10,range_ratio=0.8,seed=3"
WHOLE = {
    "prefill": {"name": "whole-prompt"},
    "budget": {"name": "token-budget", "max_num_seqs": 4, "max_num_batched_tokens": 128},
}
TIGHT = {"kv_cache": {"block_size": 4, "num_blocks": 24}}  # forces preemptions


def config(mix: dict | None = None, **extra: object) -> EngineConfig:
    data: dict = {
        "scheduler": {"budget": {"name": "token-budget", "max_num_seqs": 4, "max_num_batched_tokens": 32}}
    }
    data["scheduler"].update(mix or {})
    data.update(extra)
    return EngineConfig.model_validate(data)


@pytest.fixture(scope="module")
def tiny_profile(models) -> Profile:
    engine = Engine(models["llama"], None, profile_config(EngineConfig(), QUICK))
    return make_profile(engine, "tiny-llama", QUICK)


def token_ids(workload: Workload) -> list[list[int]]:
    return [list(r.prompt_token_ids) for r in workload.requests]


def schedules(engine) -> list[tuple[tuple[tuple[str, int], ...], tuple[str, ...]]]:
    """Every step's decision as plain data: (request, tokens) scheduled, requests preempted."""
    steps: list = []

    def listen(record: StepRecord) -> None:
        out = record.output
        steps.append(
            (
                tuple((s.seq.request_id, s.num_tokens) for s in out.scheduled),
                tuple(seq.request_id for seq in out.preempted),
            )
        )

    engine.step_listeners.append(listen)
    return steps


@pytest.mark.parametrize(
    "mix",
    [{}, {"queue": {"name": "sjf"}, "preemption": {"name": "swap"}}, WHOLE],
    ids=["fcfs+chunked+recompute", "sjf+swap", "whole-prompt"],
)
def test_the_simulated_schedule_is_the_engines_step_for_step(models, tiny_profile, mix) -> None:
    model = models["llama"]
    workload = generate(BATCH, model.config.vocab_size)
    ids = token_ids(workload)
    cfg = config(mix, **TIGHT)
    real = Engine(model, None, cfg)
    warm_up(real, ids)
    real_steps = schedules(real)
    real_run = drive([real], "real", workload, ids)
    sim = sim_engine(cfg, tiny_profile, VirtualClock())
    sim_steps = schedules(sim)
    sim_run = drive([sim], "sim", workload, ids)

    assert sim_steps == real_steps
    assert any(pre for _, pre in real_steps), "the tight KV cache should force preemptions"
    for req, a, b in zip(workload.requests, real_run.outputs, sim_run.outputs, strict=True):
        assert a.finish_reason == b.finish_reason == "length"
        assert len(a.output_token_ids) == len(b.output_token_ids) == req.max_new_tokens
        assert a.metrics.num_preemptions == b.metrics.num_preemptions
    check_blocks(sim.scheduler.blocks, [])
    assert sim.scheduler.blocks.num_used_blocks == 0
    # Virtual time: every step cost exactly what the profile says, nothing else moved the clock.
    assert sim_run.duration_s == pytest.approx(sum(s.forward_s for s in sim_run.steps))


def test_user_plugins_run_unchanged(tmp_path: Path, tiny_profile) -> None:
    workload = generate(BATCH.replace("seed=3", "seed=4") + ",clients=a:3/b:1", tiny_profile.model.vocab_size)
    path = write(tmp_path, "serial.py", SERIAL_SCHEDULER)
    whole = EngineConfig.model_validate({"plugins": [path], "scheduler": {"name": "serial"}})
    configs = [
        ("serial", whole),
        ("vtc", config({"queue": {"name": "vtc"}})),
        ("mlfq", config({"queue": "mlfq"})),
    ]
    result = simulate_suite(tiny_profile, workload, token_ids(workload), configs)
    for row in result.rows:
        assert row["kind"] == "simulated"
        assert row["completed"] == len(workload)
        assert row["total_output_tokens"] == sum(r.max_new_tokens for r in workload.requests)
    serial = result.rows[0]
    assert serial["max_seqs_per_step"] == 1  # the plugin's own decisions, not a re-implementation


def _shape(tokens: int, pairs: int, samples: int) -> StepShape:
    return StepShape(
        num_seqs=samples,
        prefill_tokens=tokens - samples,
        decode_tokens=samples,
        attn_pairs=pairs,
        kv_tokens=pairs,
        sample_rows=tuple(range(samples)),
    )


def test_the_fit_recovers_a_known_non_monotone_cost() -> None:
    knots = [1, 2, 3, 4, 8, 16, 64]
    g = {1: 0.020, 2: 0.040, 3: 0.055, 4: 0.042, 8: 0.050, 16: 0.060, 64: 0.100}  # 3 rows cost more than 4
    shapes, times = [], []
    for tokens in knots:
        for pairs in (0, 500, 5000):
            for samples in {1, min(tokens, 4)}:
                shapes.append(_shape(tokens, pairs, samples))
                times.append(g[tokens] + 2e-6 * pairs + 0.001 * samples + 0.0005 * samples)
    cost = fit_cost(shapes, times, knots)
    assert cost.fit.mean_abs < 1e-3
    for shape, t in zip(shapes, times, strict=True):
        assert cost.step_time(shape) == pytest.approx(t, rel=1e-3)
    assert cost.step_time(_shape(3, 0, 1)) > cost.step_time(_shape(4, 0, 1))


def test_decode_keys_and_prompt_pairs_are_priced_apart_and_a_refit_reproduces_the_fit() -> None:
    # Decode rows read their keys (memory: per key); prompt chunks multiply queries by keys (compute: per pair).
    knots = [1, 4, 16, 64, 256]
    g = {1: 0.02, 4: 0.03, 16: 0.04, 64: 0.08, 256: 0.25}
    shapes = [
        StepShape(rows, 0, rows, rows * context, rows * context, tuple(range(rows)))
        for rows in (1, 4, 16)
        for context in (16, 512, 2048)
    ] + [
        StepShape(1, q, 0, q * start + q * (q + 1) // 2, start + q, (0,))
        for q in (64, 256)
        for start in (0, 256, 1024)
    ]
    times = [g[s.num_tokens] + 1e-7 * s.attn_pairs + 2e-5 * s.kv_tokens + 0.001 * s.num_seqs for s in shapes]
    cost = fit_cost(shapes, times, knots)
    assert cost.fit.mean_abs < 1e-3
    assert cost.per_kv_token_s == pytest.approx(2e-5, rel=1e-2)
    assert cost.per_attn_pair_s == pytest.approx(1e-7, rel=1e-2)
    long_decode = StepShape(1, 0, 1, 2048, 2048, (0,))
    assert cost.step_time(long_decode) == pytest.approx(0.021 + (2e-5 + 1e-7) * 2048, rel=1e-3)
    again = refit(cost)
    assert again.knot_s == pytest.approx(cost.knot_s) and again.per_kv_token_s == pytest.approx(cost.per_kv_token_s)


def test_nnls_keeps_coefficients_non_negative() -> None:
    import numpy as np

    a = np.array([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]])
    b = np.array([3.0, 2.0, 1.0])  # unconstrained slope would be -1
    x = nnls(a, b)
    assert (x >= 0).all()
    assert x[1] == 0 and x[0] == pytest.approx(2.0)


def test_the_h100_roofline_matches_published_linear_layer_timings() -> None:
    timings = load_linear(DATA / "h100-llama-2-7b-linear.csv")
    hw = roofline_hardware("h100")  # the shipped roofline's H100 numbers and fitted efficiencies
    errors = check_linear(hw, LLAMA_2_7B, timings)
    assert errors["points"] > 200
    assert errors["mean_abs"] < 0.08  # 5.2 % when the efficiencies were fitted (docs/simulate.md)
    assert errors["max_abs"] < 0.25


def test_the_h200_profile_prices_steps_like_the_hardware_would() -> None:
    profile = load_profile("h200-llama-3-8b")
    one = profile.step_time(_shape(1, 1000, 1), 16)
    weights = sum(i * o for i, o in profile.model.linear_layers()) * profile.model.num_layers * 2
    assert one > weights / 4.8e12  # cannot beat reading the weights once
    assert one < 3 * weights / 4.8e12 + 0.01
    wide = profile.step_time(_shape(256, 256 * 1000, 256), 16)
    assert one < wide < 256 * one  # batching amortises the weight reads


def test_profile_files_round_trip_and_bad_ones_are_named(tmp_path: Path, tiny_profile) -> None:
    path = tmp_path / "p.json"
    tiny_profile.save(path)
    again = load_profile(path)
    assert again == tiny_profile
    assert again.identity.source == "measured" and again.identity.threads >= 1
    data = json.loads(path.read_text())
    del data["model"]["num_layers"]
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=r"p\.json: model\.num_layers"):
        load_profile(path)
    path.write_text("{")
    with pytest.raises(ProfileError, match="not valid JSON"):
        load_profile(path)
    with pytest.raises(ProfileError, match="h200-llama-3-8b"):
        load_profile(tmp_path / "missing.json")


def test_simulated_metrics_follow_the_real_run_they_were_fitted_on(models) -> None:
    """A loose check of the whole path: fit on one real run's steps, simulate that run, compare.

    The bound is loose because the real run shares a small machine with other
    work; it catches a simulator that mis-times steps or arrivals, not noise.
    """
    model = models["llama"]
    workload = generate(
        "poisson:n=24,rate=60,lengths=uniform,input_len=32,output_len=16,seed=5", model.config.vocab_size
    )
    ids = token_ids(workload)
    cfg = config()
    engine = Engine(model, None, cfg)
    warm_up(engine, ids)
    with timed_steps(engine) as timed:
        real = drive([engine], "real", workload, ids)
    assert [t.stats for t in timed] == [s for s in real.steps if s.num_seqs]
    cost = fit_cost([t.shape for t in timed], [t.stats.total_s for t in timed], QUICK.knots)
    profile = measured_profile(model, cost)
    sim = drive([sim_engine(cfg, profile, VirtualClock())], "sim", workload, ids)

    def mean(run, key: str) -> float:
        vals = [getattr(o.metrics, key) for o in run.outputs]
        return sum(vals) / len(vals)

    assert sim.duration_s == pytest.approx(real.duration_s, rel=0.5)
    assert mean(sim, "e2e") == pytest.approx(mean(real, "e2e"), rel=0.5)
    assert mean(sim, "ttft") == pytest.approx(mean(real, "ttft"), rel=1.0)


def measured_profile(model, cost) -> Profile:
    identity = Identity(hardware="here", model="tiny", dtype="float32", backend="sdpa", source="measured")
    return Profile(identity=identity, model=ModelShape.of("tiny", model.config), cost=cost)


class RoundRobin:
    def __init__(self) -> None:
        self.n = 0
        self.finished: list[tuple[str, int]] = []

    def place(self, request: BenchRequest, prompt: Seq[int], engines: Seq[EngineCore]) -> int:
        self.n += 1
        return (self.n - 1) % len(engines)

    def done(self, request_id: str, replica: int) -> None:
        self.finished.append((request_id, replica))


def test_several_replicas_share_one_virtual_timeline() -> None:
    profile = load_profile("h200-llama-3-8b")
    workload = generate("poisson:n=200,rate=50,lengths=sharegpt,seed=1", profile.model.vocab_size)
    ids = token_ids(workload)
    cfg = EngineConfig.from_dict({}, ["scheduler.budget.max_num_seqs=8"])

    def run(n: int, placement=None):
        engines = [sim_engine(cfg, profile, VirtualClock()) for _ in range(n)]
        return drive(engines, f"x{n}", workload, ids, placement=placement), engines

    one, _ = run(1)
    rr = RoundRobin()
    four, replicas = run(4, rr)
    assert all(o.finish_reason == "length" for o in four.outputs)
    assert sorted(r for _, r in rr.finished) == sorted(i % 4 for i in range(200))
    assert {len(e.step_stats) > 0 for e in replicas} == {True}
    ttft = lambda run: sum(o.metrics.ttft for o in run.outputs) / len(run.outputs)  # noqa: E731
    assert ttft(four) < ttft(one)  # four engines drain the queue that one engine builds
    for out, req in zip(four.outputs, workload.requests, strict=True):
        assert out.metrics.arrival_time == pytest.approx(req.arrival_s)


def test_cb_profile_then_cb_simulate(cb_tiny_model_dir, tmp_path: Path, capsys) -> None:
    prof = tmp_path / "tiny.json"
    # --force: a quick profile on a shared test machine may fit poorly; this test is about the round trip.
    assert main(["profile", "--model", str(cb_tiny_model_dir), "--quick", "--out", str(prof), "--force"]) == 0
    assert "mean step-time error" in capsys.readouterr().out
    out = tmp_path / "sim.json"
    rc = main(
        [
            "simulate", "--profile", str(prof), "--model", str(cb_tiny_model_dir), "--no-progress", "--force",
            "--workload", "poisson:n=6,rate=20,lengths=fixed,input_len=8,output_len=4,clients=a:1/b:1",
            "--policy", "fcfs", "--policy", "priority", "--json", str(out),
        ]
    )  # fmt: skip
    assert rc == 0
    table = capsys.readouterr().out
    assert "out tok/s" in table and "priority" in table
    data = json.loads(out.read_text())
    assert [r["name"] for r in data["rows"]] == ["fcfs", "priority"]
    assert all(r["completed"] == 6 and r["total_output_tokens"] == 24 for r in data["rows"])
    assert data["workload"]["profile"]["source"] == "measured"
    # --refit fits the recorded steps again, timing nothing; a roofline profile has none to fit.
    again = tmp_path / "again.json"
    assert main(["profile", "--refit", str(prof), "--out", str(again), "--force"]) == 0
    first, second = load_profile(prof).cost, load_profile(again).cost
    assert second.steps == first.steps and second.knot_s == pytest.approx(first.knot_s)
    assert main(["profile", "--refit", "h200-llama-3-8b", "--out", str(again)]) == 2
    assert "not a measured profile with recorded steps" in capsys.readouterr().err
    # Profiles of one set-up taken at different times fit one model over all their steps...
    both = tmp_path / "both.json"
    assert main(["profile", "--refit", str(prof), str(again), "--out", str(both), "--force"]) == 0
    joined = load_profile(both)
    assert joined.cost.steps == first.steps + second.steps and joined.identity == load_profile(prof).identity
    assert load_profile(prof).identity.linear in ("onednn", "standard")  # what the linear layers ran
    assert load_profile(prof).identity.backend_variant == "decode paged"  # and the attention
    # ...and profiles of different set-ups are refused, naming what differs.
    other = load_profile(prof)
    other = other.model_copy(update={"identity": other.identity.model_copy(update={"threads": 7})})
    other.save(tmp_path / "other.json")
    assert main(["profile", "--refit", str(prof), str(tmp_path / "other.json"), "--out", str(both)]) == 2
    err = capsys.readouterr().err
    assert "other.json: measured with threads 7" in err and "same machine" in err
    gathered = load_profile(prof)
    gathered = gathered.model_copy(
        update={"identity": gathered.identity.model_copy(update={"backend_variant": "decode gather"})}
    )
    gathered.save(tmp_path / "gathered.json")
    assert main(["profile", "--refit", str(prof), str(tmp_path / "gathered.json"), "--out", str(both)]) == 2
    assert "measured with backend_variant 'decode gather'" in capsys.readouterr().err


def test_cb_simulate_refuses_a_bad_profile_in_one_line(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"version": 1}')
    assert main(["simulate", "--profile", str(bad), "--workload", "poisson:n=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("cb: error: profile") and "identity" in err and "\n" not in err


BROKEN_BUDGET = """
    from cbcore import hookimpl
    from cbcore.policies import TokenBudget


    class Broken(TokenBudget):
        name = "broken"

        def limits(self, state):  # about no single request: the engine stops, the row fails
            raise RuntimeError("broken on purpose")


    @hookimpl
    def cbcore_register_policies():
        return [Broken]
"""


def test_a_failing_row_is_reported_the_others_run_and_cb_simulate_exits_1(tmp_path: Path, capsys) -> None:
    config = tmp_path / "broken.json"
    config.write_text(json.dumps({"plugins": [write(tmp_path, "broken.py", BROKEN_BUDGET)],
                                  "scheduler": {"budget": {"name": "broken"}}}))  # fmt: skip
    out = tmp_path / "rows.json"
    argv = ["simulate", "--profile", "h200-llama-3-8b", "--workload", "poisson:n=5,seed=0", "--no-progress"]
    (tmp_path / "plain.json").write_text("{}")
    assert main([*argv, "--config", str(config), "--config", str(tmp_path / "plain.json"), "--json", str(out)]) == 1
    broken, plain = json.loads(out.read_text())["rows"]
    assert broken["kind"] == "simulated" and "broken on purpose" in broken["error"]
    assert plain["completed"] == 5 and "error" not in plain
    assert re.search(r"broken: FAILED: PolicyError: .* RuntimeError: broken on purpose", capsys.readouterr().out)


def test_a_profile_from_before_packed_linears_loads_without_a_linear_kind():
    base = {"hardware": "cpu", "model": "m", "dtype": "float32", "backend": "sdpa", "source": "measured"}
    assert Identity.model_validate({**base, "linear_transposed_rows": [2, 3]}).linear is None
    assert Identity.model_validate({**base, "linear_orders": {"1": "skinny"}}).linear is None
    assert Identity.model_validate({**base, "linear": "onednn"}).linear == "onednn"
    with pytest.raises(ValueError, match="linear"):
        Identity.model_validate({**base, "linear": "sideways"})
