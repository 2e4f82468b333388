"""One driver, one suite, one pool size and one EOS rule for `cb bench` and `cb simulate`."""

from __future__ import annotations

import pytest

from cbcore.bench.driver import RunResult, VirtualClock, drive
from cbcore.bench.suite import Row, run_rows
from cbcore.bench.workload import BenchRequest, Workload
from cbcore.config import EngineConfig
from cbcore.engine import Engine
from cbcore.models.loading import eos_token_ids
from cbcore.scheduling.sampling_params import SamplingParams
from cbcore.sim.executor import sim_engine, sim_num_blocks
from cbcore.sim.model_shape import ModelShape
from cbcore.sim.profile import Identity, Profile, load_profile
from cbcore.testing import tiny_model


def request(rid: str, at: float, prompt_len: int, out: int = 3) -> BenchRequest:
    return BenchRequest(request_id=rid, arrival_s=at, max_new_tokens=out, prompt_token_ids=tuple(range(3, 3 + prompt_len)))


def ids(workload: Workload) -> list[list[int]]:
    return [r.token_ids(None) for r in workload.requests]


class FakeWallClock:
    """Wall time that only sleeping moves: the driver's wall path, deterministic."""

    def __init__(self) -> None:
        self.now, self.slept = 100.0, []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_on_the_wall_clock_waiting_for_an_arrival_sleeps_and_counts_as_idle() -> None:
    clock = FakeWallClock()
    engine = Engine(tiny_model("llama"), None, EngineConfig(), clock=clock)
    workload = Workload("w", (request("a", 0.0, 5), request("b", 2.5, 5)))
    run = drive([engine], "wall", workload, ids(workload), sleep=clock.sleep)
    assert clock.slept == [2.5]  # steps take no time on this clock: "a" is done before "b" arrives
    assert [o.metrics.arrival_time for o in run.outputs] == [100.0, 102.5]
    assert (run.kind, run.duration_s, run.busy_s) == ("cbcore", 2.5, 0.0)


def test_a_refused_last_arrival_ends_the_run_at_its_arrival_and_busy_time_is_the_steps() -> None:
    profile = load_profile("h200-llama-3-8b")
    config = EngineConfig.from_dict({}, ["kv_cache.num_blocks=4"])  # 64 tokens: the second prompt never fits
    workload = Workload("w", (request("a", 0.0, 10), request("b", 5.0, 500)))
    run = drive([sim_engine(config, profile, VirtualClock())], "sim", workload, ids(workload))
    assert [o.finish_reason for o in run.outputs] == ["length", "error"]
    assert run.kind == "simulated" and run.duration_s == 5.0
    assert run.busy_s == pytest.approx(sum(s.forward_s for s in run.steps))


def test_engines_share_one_timeline_only_on_virtual_clocks() -> None:
    model = tiny_model("llama")
    workload = Workload("w", (request("a", 0.0, 5),))
    with pytest.raises(ValueError, match="only on virtual clocks"):
        drive([Engine(model), Engine(model)], "two", workload, ids(workload))


def test_a_row_that_fails_is_reported_with_its_error_and_the_others_still_run() -> None:
    profile = load_profile("h200-llama-3-8b")
    workload = Workload("w", (request("a", 0.0, 10),))

    def good() -> RunResult:
        return drive([sim_engine(EngineConfig(), profile, VirtualClock())], "good", workload, ids(workload))

    def bad() -> RunResult:
        raise RuntimeError("the policy broke\nsecond line")

    result = run_rows(workload, [Row("bad", "simulated", bad), Row("good", "simulated", good)])
    assert result.rows[0] == {"name": "bad", "kind": "simulated", "error": "RuntimeError: the policy broke"}
    assert result.rows[1]["completed"] == 1 and "error" not in result.rows[1]
    with pytest.raises(ValueError, match="two rows share a name"):
        run_rows(workload, [Row("x", "simulated", good), Row("x", "simulated", good)])


@pytest.mark.parametrize("kv", [["kv_cache.max_memory_mb=1.5"], ["kv_cache.num_blocks=7"], []])
def test_the_simulated_pool_is_sized_as_the_engine_sizes_its_own(kv: list[str]) -> None:
    model = tiny_model("llama")
    config = EngineConfig.from_dict({}, kv)
    identity = Identity(hardware="here", model="tiny", dtype="float32", backend="sdpa", source="measured")
    profile = Profile(identity=identity, model=ModelShape.of("tiny", model.config), cost=_no_cost())
    assert sim_num_blocks(config, profile) == Engine(model, None, config).scheduler.blocks.num_blocks


def _no_cost():
    from cbcore.sim.fitted import fit_cost
    from cbcore.sim.shape import StepShape

    widths = range(1, 11)
    shapes = [StepShape(n, 0, n, n, n, tuple(range(n))) for n in widths]
    return fit_cost(shapes, [0.01 * n for n in widths], [1, 2, 4, 8])


def test_eos_ids_come_from_the_generation_config_else_the_model_config() -> None:
    model = tiny_model("llama")
    assert eos_token_ids(model) == (2,)
    model.generation_config.eos_token_id = [2, 5]
    assert eos_token_ids(model) == (2, 5)
    model.generation_config.eos_token_id = None
    assert eos_token_ids(model) == (model.config.eos_token_id,)
    assert Engine(model).eos_token_ids == frozenset(eos_token_ids(model))


def test_an_ended_request_is_freed_by_reference_counting_alone() -> None:
    """A long simulation ends thousands of requests: each must go when it ends, not wait for a full
    collection of the garbage collector (which walks every live object, a pause that grows with the run)."""
    import gc
    import weakref

    engine = sim_engine(EngineConfig(), load_profile("h200-llama-3-8b"), VirtualClock())
    engine.add_request(list(range(3, 40)), SamplingParams(max_new_tokens=3, ignore_eos=True), request_id="a")
    seq = weakref.ref(engine.requests["a"])
    gc.disable()
    try:
        while engine.has_unfinished():
            engine.step()
        engine.add_request([5, 6, 7], request_id="b")
        engine.step()  # the scheduler keeps only the step it planned last
        assert seq() is None  # the sequence and its view (which reads it) are gone
    finally:
        gc.enable()
