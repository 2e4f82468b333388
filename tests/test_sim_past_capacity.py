"""The simulator past capacity: the real run's decisions, and steps wider than the profile priced sanely.

Past capacity a run with a tight KV cache preempts, and the recomputed
prompts come back together in steps wider than any the profiler timed. Two
things must then hold for a simulated run to follow a real one: given the
same arrivals in the same steps, the simulator makes the real engine's
decisions step for step (it runs the engine's own scheduler), and a step
wider than the profile's widest costs what the widest did per token, not
nothing.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

import pytest

from cbcore.bench.driver import VirtualClock, drive, submit, warm_up
from cbcore.bench.generator import generate
from cbcore.config import EngineConfig
from cbcore.engine import Engine
from cbcore.engine_core import EngineCore, StepRecord
from cbcore.sim.executor import sim_engine
from cbcore.sim.fitted import fit_cost, supported_knots
from cbcore.sim.model_shape import ModelShape
from cbcore.sim.profile import Identity, Profile
from cbcore.sim.profiler import QUICK
from cbcore.sim.shape import StepShape

# Arrivals faster than the tiny engine serves them on any machine, prompts of 8-40 tokens: saturated.
SATURATED = "poisson:n=16,rate=1000,lengths=uniform,input_len=24,output_len=12,range_ratio=0.6,seed=7"


def prefill(tokens: int, start: int = 0) -> StepShape:
    """A prompt chunk of ``tokens`` after ``start`` cached ones (the keys it reads differ from its width)."""
    return StepShape(1, tokens, 0, tokens * start + tokens * (tokens + 1) // 2, start + tokens, (0,))


def linear_times(shapes: Seq[StepShape]) -> list[float]:
    return [0.01 + 0.004 * s.num_tokens + 2e-5 * s.kv_tokens + 1e-7 * s.attn_pairs for s in shapes]


def test_a_grid_knot_past_the_widest_step_does_not_price_wider_steps_as_free() -> None:
    # The quick grid's knots reach 272 tokens; its prefills stop at 256 (what `cb profile --quick` times).
    assert max(QUICK.knots) > 256
    shapes = [prefill(n, start) for n in (1, 2, 3, 4, 8, 16, 32, 64, 128, 256) for start in (0, 512)]
    cost = fit_cost(shapes, linear_times(shapes), QUICK.knots)
    for tokens in (264, 334, 600):  # several recomputed prompts in one step
        truth = linear_times([prefill(tokens)])[0]
        assert cost.step_time(prefill(tokens)) == pytest.approx(truth, rel=0.15), tokens
    assert cost.knots[-1] == 256


def test_a_knot_with_no_timed_step_beside_it_is_dropped_not_set_to_zero() -> None:
    shapes = [prefill(n, start) for n in (1, 2, 4, 8, 16, 256) for start in (0, 512)]
    assert supported_knots([1, 2, 4, 8, 16, 64, 256, 512], [s.num_tokens for s in shapes]) == [1, 2, 4, 8, 16, 256]
    cost = fit_cost(shapes, linear_times(shapes), [1, 2, 4, 8, 16, 64, 256, 512])
    truth = linear_times([prefill(64)])[0]
    assert cost.step_time(prefill(64)) == pytest.approx(truth, rel=0.25)


def flat_profile(model: Any) -> Profile:
    """Any price will do: the arrivals are replayed step for step, so no decision reads the clock's speed."""
    shapes = [prefill(n, start) for n in (1, 4, 16, 64) for start in (0, 512)]
    identity = Identity(hardware="here", model="tiny", dtype="float32", backend="sdpa", source="measured")
    cost = fit_cost(shapes, linear_times(shapes), [1, 4, 16, 64])
    return Profile(identity=identity, model=ModelShape.of("tiny", model.config), cost=cost)


def decisions(engine: EngineCore) -> list[tuple[tuple[str, ...], tuple[tuple[str, int], ...], tuple[str, ...]]]:
    """Per step: the requests added since the step before, who ran with how many tokens, who was preempted."""
    steps: list = []
    arrived: list[str] = []
    add = engine.add_request

    def add_request(*args: Any, **kwargs: Any) -> Any:
        arrived.append(kwargs["request_id"])
        return add(*args, **kwargs)

    def listen(record: StepRecord) -> None:
        out = record.output
        steps.append(
            (
                tuple(arrived),
                tuple((s.seq.request_id, s.num_tokens) for s in out.scheduled),
                tuple(seq.request_id for seq in out.preempted),
            )
        )
        arrived.clear()

    engine.add_request = add_request  # type: ignore[method-assign]
    engine.step_listeners.append(listen)
    return steps


@pytest.mark.parametrize("mix", [{"queue": {"name": "fcfs"}}, {"queue": {"name": "priority"}, "prefill": {"name": "chunked-prefill"}}],
                         ids=["fcfs", "priority+chunked"])  # fmt: skip
def test_the_real_runs_arrivals_replayed_give_its_decisions_step_for_step(models, mix) -> None:
    model = models["llama"]
    spec = SATURATED + (",priorities=0:1/1:3" if mix["queue"]["name"] == "priority" else "")
    workload = generate(spec, model.config.vocab_size)
    ids = [list(r.prompt_token_ids) for r in workload.requests]
    cfg = EngineConfig.model_validate(
        {
            "scheduler": {"budget": {"name": "token-budget", "max_num_seqs": 8, "max_num_batched_tokens": 64}, **mix},
            "kv_cache": {"block_size": 4, "num_blocks": 20, "prefix_caching": False},
        }
    )
    real = Engine(model, None, cfg)
    warm_up(real, ids)
    real_steps = decisions(real)
    drive([real], "real", workload, ids)
    assert sum(len(pre) for *_, pre in real_steps) >= 3, "the tight KV cache should force preemptions"
    assert len({arrived for arrived, *_ in real_steps if arrived}) > 1, "arrivals should spread over steps"

    sim = sim_engine(cfg, flat_profile(model), VirtualClock())
    sim_steps = decisions(sim)
    requests = {r.request_id: (r, p) for r, p in zip(workload.requests, ids, strict=True)}
    for arrived, *_ in real_steps:
        for rid in arrived:
            req, prompt = requests[rid]
            assert submit(sim, req, prompt, req.arrival_s) is None
        sim.step()
    assert sim_steps == real_steps
    assert not sim.has_unfinished()
