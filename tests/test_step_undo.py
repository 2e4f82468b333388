"""A step that fails is undone: the engine's state equals the state before it, and it runs on exactly.

Each test drives an engine to a chosen step and makes that step fail at a
chosen point: the forward raising after planning (the step raises; the
state must equal the state before it), or the bookkeeping after the commit
raising; or a policy raising about one request after the planner already
preempted, grew and admitted, where the engine ends that request and plans
the step again, and the state must equal a twin engine's in which that
request was aborted before the step. States are compared through public
state only (:func:`support.engine_state.engine_state`); then every request runs to
its end, token for token against its prompt run alone. The failing plugins
below are loaded by path, as a user's plugin file would be.
"""

from __future__ import annotations

import copy
from typing import Any, ClassVar

import pytest
from support import PROMPTS
from support.engine_state import assert_same_state, cached_tokens, engine_state

from cbcore import Engine, EngineConfig, SamplingParams, SchedulerError
from cbcore.plugins import load_class
from cbcore.policies import FCFS, ChunkedPrefill
from cbcore.testing import assert_equivalent, compare_greedy, reference_generate

HERE = __file__
CAP = 10  # tokens each request generates


class RaisingPrefill(ChunkedPrefill):
    """Raises in ``num_tokens`` for the request named by ``raise_for``, once."""

    name = "raising-prefill"
    raise_for: ClassVar[str | None] = None

    def num_tokens(self, seq, tokens_left, scheduled):
        if seq.request_id == type(self).raise_for:
            raise RuntimeError(f"num_tokens failed for {seq.request_id}")
        return super().num_tokens(seq, tokens_left, scheduled)


class RaisingQueue(FCFS):
    """FCFS whose ``on_step_end`` (for ``raise_at_step_end``) or ``on_finish`` (for ``raise_on_finish``) raises."""

    name = "raising-queue"
    raise_at_step_end: ClassVar[str | None] = None
    raise_on_finish: ClassVar[str | None] = None

    def on_step_end(self, results, now):
        if any(r.seq.request_id == type(self).raise_at_step_end for r in results):
            raise RuntimeError("on_step_end failed")

    def on_finish(self, seq, now):
        if seq.request_id == type(self).raise_on_finish:
            type(self).raise_on_finish = None
            raise RuntimeError(f"on_finish failed for {seq.request_id}")


def plugin(cls: str) -> Any:
    """The class the engine loads from this file (its own module, not this test module's copy)."""
    return load_class(f"{HERE}:{cls}")


@pytest.fixture(autouse=True)
def disarmed():
    prefill, queue = plugin("RaisingPrefill"), plugin("RaisingQueue")
    prefill.raise_for = queue.raise_on_finish = queue.raise_at_step_end = None
    yield
    prefill.raise_for = queue.raise_on_finish = queue.raise_at_step_end = None


class Run:
    """One engine: FCFS, prefill chunks of 4, recompute (the raising plugins in their slots); blocks of 4 tokens."""

    def __init__(self, model, num_blocks: int) -> None:
        scheduler = {
            "queue": {"name": f"{HERE}:RaisingQueue"},
            "prefill": {"name": f"{HERE}:RaisingPrefill", "chunk_size": 4},
            "budget": {"name": "token-budget", "max_num_seqs": 4, "max_num_batched_tokens": 32},
        }
        kv = {"block_size": 4, "num_blocks": num_blocks, "prefix_caching": True}
        config = EngineConfig.model_validate(
            {"backend": {"name": "eager"}, "kv_cache": kv, "scheduler": scheduler}
        )
        self.now = 0.0  # one second a step: two runs of one scenario read the same times
        self.model, self.engine = model, Engine(model, config=config, clock=lambda: self.now)
        self.prompts: dict[str, list[int]] = {}
        self.caps: dict[str, int] = {}
        self.done: dict[str, Any] = {}

    def add(self, rid: str, prompt: list[int], cap: int = CAP) -> None:
        self.prompts[rid] = prompt
        self.caps[rid] = cap
        self.engine.add_request(prompt, SamplingParams(max_new_tokens=cap), request_id=rid)

    def step(self, n: int = 1) -> list[Any]:
        outs = []
        for _ in range(n):
            outs = self.engine.step()
            self.now += 1.0
            for out in outs:
                if out.finished:
                    self.done[out.request_id] = out
        return outs

    def forget(self, rid: str) -> None:
        """``rid`` ended apart from the others: the exact-finish check leaves it out."""
        del self.prompts[rid], self.caps[rid]
        self.done.pop(rid, None)

    def step_until(self, done) -> None:
        for _ in range(50):
            if done(self.engine.scheduler.get):
                return
            self.step()
        raise AssertionError("the condition never held")

    def failing_step(self, match: str) -> None:
        """The next step must fail with ``match``; the engine's state must then equal what it was before."""
        before = engine_state(self.engine, self.prompts)
        with pytest.raises((SchedulerError, RuntimeError), match=match):
            self.engine.step()
        assert_same_state(before, engine_state(self.engine, self.prompts))

    def finish_exactly(self) -> None:
        """Run every request to its end; each output equals its prompt's run alone."""
        steps = 0
        while self.engine.has_unfinished():
            assert (steps := steps + 1) < 200, "no end after 200 steps"
            self.step()
        rids = sorted(self.prompts)
        assert sorted(r for r in self.done if r in self.prompts) == rids
        outs = [self.done[r] for r in rids]
        assert all(o.finish_reason in ("stop", "length") for o in outs), [o.error for o in outs]
        refs = reference_generate(self.model, [self.prompts[r] for r in rids], [self.caps[r] for r in rids])
        assert_equivalent(compare_greedy(self.model, outs, refs))
        blocks = self.engine.scheduler.blocks
        assert blocks.num_free_blocks == blocks.num_blocks


def preempting_step(models) -> Run:
    """x decodes into a new block where none is free: z (newest) is preempted, x grows, then y's next chunk."""
    run = Run(models["llama"], num_blocks=7)
    run.add("x", PROMPTS[3][:7])
    run.add("y", PROMPTS[5][:24], cap=4)
    run.add("z", PROMPTS[6][:5])
    run.step(3)
    get = run.engine.scheduler.get
    assert [get(r).num_computed_tokens for r in "xyz"] == [8, 12, 6]  # x's 2 blocks full, y prefilling
    assert run.engine.scheduler.blocks.num_free_blocks == 0
    return run


def admitting_step(models) -> Run:
    """a decodes into a new block, then b is admitted (two blocks of a's prompt from the cache), then c."""
    run = Run(models["llama"], num_blocks=16)
    run.add("a", PROMPTS[3][:8])
    run.step(2)
    run.add("b", PROMPTS[3][:8] + PROMPTS[4][:3])
    run.add("c", PROMPTS[5][:5])
    assert cached_tokens(run.engine.scheduler.blocks, run.prompts["b"]) == 8
    return run


SCENARIOS = {"preempting": (preempting_step, "y"), "admitting": (admitting_step, "c")}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_a_policy_raising_after_the_planner_changed_state_plans_the_step_as_if_its_request_were_gone(
    models, scenario
):
    make, victim = SCENARIOS[scenario]
    run, twin = make(models), make(models)
    assert twin.engine.abort(victim)  # the twin loses the request before the step, by abort
    twin.forget(victim)
    twin.step()
    plugin("RaisingPrefill").raise_for = victim
    (ended,) = [o for o in run.step() if o.request_id == victim]
    assert ended.finish_reason == "error" and ended.error == "prefill policy 'raising-prefill' raised RuntimeError in num_tokens()"
    run.forget(victim)
    assert_same_state(engine_state(twin.engine, twin.prompts), engine_state(run.engine, run.prompts))
    run.finish_exactly()


def forward_fails_once_after_writing(run: Run, monkeypatch) -> None:
    """The next forward writes its KV, then raises (a device error or a backend failing in a late layer)."""
    executor = run.engine.executor
    real = executor.forward

    def fails_once(prepared):
        monkeypatch.setattr(executor, "forward", real)
        real(prepared)
        raise RuntimeError("device lost")

    monkeypatch.setattr(executor, "forward", fails_once)


def test_a_forward_raising_after_planning_leaves_the_engine_as_before(models, monkeypatch):
    run = admitting_step(models)
    forward_fails_once_after_writing(run, monkeypatch)
    run.failing_step("device lost")
    run.finish_exactly()


def test_a_forward_raising_costs_a_request_whose_blocks_it_reused_a_recompute_only(models, monkeypatch):
    """z is preempted and its two blocks go to x and y, whose KV the forward writes there before it raises.

    Undone, z runs again but cannot keep those blocks' KV: it holds no block and
    computes its tokens again; nothing else differs from the state before, and
    with x aborted (so that nothing preempts z again) every output is exact.
    """
    run = preempting_step(models)
    before = engine_state(run.engine, run.prompts)
    z_blocks = before["requests"]["z"]["block_table"]
    forward_fails_once_after_writing(run, monkeypatch)
    with pytest.raises(RuntimeError, match="device lost"):
        run.engine.step()
    expected = copy.deepcopy(before)
    expected["requests"]["z"].update(num_computed_tokens=0, block_table=[])
    blocks = expected["blocks"]
    blocks["num_free_blocks"] += len(z_blocks)
    blocks["num_used_blocks"] -= len(z_blocks)
    blocks["num_cached_blocks"] -= 1  # z's full first block was registered; the step evicted it to reuse it
    for b in z_blocks:
        blocks["ref_counts"][b] = 0
    expected["cached_tokens"].update({"prompt z": 0, "tokens z": 0})
    assert_same_state(expected, engine_state(run.engine, run.prompts))
    assert run.engine.abort("x")
    del run.prompts["x"]
    run.finish_exactly()


def test_the_admission_time_of_a_request_admitted_by_an_undone_step_is_its_later_admission(
    models, monkeypatch
):
    run = admitting_step(models)
    forward_fails_once_after_writing(run, monkeypatch)
    run.failing_step("device lost")
    later = run.now = run.now + 5.0  # the step is tried again later: b is admitted then
    run.step()
    b = run.engine.scheduler.get("b")
    assert b.first_scheduled_time == later
    run.finish_exactly()
    assert run.done["b"].metrics.first_scheduled_time == later


def test_bookkeeping_failing_after_the_commit_takes_back_the_tokens_and_the_cache_registrations(models, monkeypatch):
    """The step's decode fills a block (the cache registers it), then its bookkeeping raises: all of it is undone."""
    run = Run(models["llama"], num_blocks=16)
    run.add("a", PROMPTS[3][:7])
    run.add("b", PROMPTS[5][:6])
    run.step_until(lambda get: get("a").num_output_tokens == 1)  # a's second block holds 3 of 4 tokens
    assert run.engine.scheduler.get("a").num_computed_tokens == 7
    blocks = run.engine.scheduler.blocks
    cached = blocks.num_cached_blocks
    sched = run.engine.scheduler
    real = sched.on_step_end

    def registers_then_fails(out, results):
        monkeypatch.setattr(sched, "on_step_end", real)
        blocks.register_computed([sched.get("a")])  # what the bookkeeping does first
        raise RuntimeError("bookkeeping failed")

    monkeypatch.setattr(sched, "on_step_end", registers_then_fails)
    run.failing_step("bookkeeping failed")
    run.step()  # the same step again: now a's second block is full and registered
    assert blocks.num_cached_blocks == cached + 1
    run.finish_exactly()


def test_an_event_raising_after_the_commit_ends_its_request_and_the_others_run_exactly(models):
    """Events come after the commit: the step stands, the request the event concerned ends, nothing is undone."""
    run = Run(models["llama"], num_blocks=16)
    run.add("a", PROMPTS[3][:7])
    run.add("b", PROMPTS[5][:6])
    run.step_until(lambda get: get("a").num_output_tokens == 1)
    plugin("RaisingQueue").raise_at_step_end = "a"
    tokens = run.engine.scheduler.get("a").num_output_tokens
    (a,) = [o for o in run.step() if o.request_id == "a"]
    assert a.finish_reason == "error" and a.error == "queue policy 'raising-queue' raised RuntimeError in on_step_end()"
    assert len(a.output_token_ids) == tokens + 1  # the step's token stands
    assert run.engine.scheduler.get("a") is None
    run.forget("a")
    run.finish_exactly()


def test_a_finish_event_raising_is_logged_the_request_keeps_its_result_and_the_next_steps_run(models):
    run = Run(models["llama"], num_blocks=16)
    run.add("a", PROMPTS[3][:6], cap=3)
    run.add("b", PROMPTS[5][:9])
    run.add("c", PROMPTS[6][:4])
    run.step_until(lambda get: get("a").num_output_tokens == 2)  # its last token comes next step
    plugin("RaisingQueue").raise_on_finish = "a"
    run.step()
    assert run.done["a"].finish_reason == "length"
    run.finish_exactly()


def test_a_forward_raising_after_reusing_only_the_last_block_of_a_request_costs_it_that_block(models, monkeypatch):
    """z is preempted and x's decode writes the first slot of z's last block (one token of z in it): undone,
    z keeps its full first block and computes its fifth token again; nothing else differs."""
    run = Run(models["llama"], num_blocks=4)
    run.add("x", PROMPTS[3][:7])
    run.step()
    run.add("z", PROMPTS[6][:4])
    run.step(2)
    get = run.engine.scheduler.get
    assert [get(r).num_computed_tokens for r in "xz"] == [8, 5]
    assert run.engine.scheduler.blocks.num_free_blocks == 0
    before = engine_state(run.engine, run.prompts)
    z_first, z_last = before["requests"]["z"]["block_table"]
    forward_fails_once_after_writing(run, monkeypatch)
    with pytest.raises(RuntimeError, match="device lost"):
        run.engine.step()
    expected = copy.deepcopy(before)
    expected["requests"]["z"].update(num_computed_tokens=4, block_table=[z_first])
    expected["blocks"].update(num_free_blocks=1, num_used_blocks=3)
    expected["blocks"]["ref_counts"][z_last] = 0
    assert_same_state(expected, engine_state(run.engine, run.prompts))
    assert run.engine.abort("x")
    del run.prompts["x"]
    run.finish_exactly()
