"""What lets the simulator run a production hour: prompts held as 32-bit arrays, waiting queues
that are not swept every step, and ended requests freed while the run goes on."""

from __future__ import annotations

import gc
import random
from array import array

import pytest

from cbcore.bench.driver import VirtualClock, drive
from cbcore.bench.synthetic import PromptIds, SyntheticPrompt
from cbcore.bench.workload import BenchRequest, Workload
from cbcore.config import EngineConfig
from cbcore.engine_core import EngineCore, StepRecord
from cbcore.policies.priority import Priority
from cbcore.scheduling.request import RequestError
from cbcore.scheduling.sampling_params import SamplingParams
from cbcore.scheduling.sequence import Prefix, Sequence
from cbcore.scheduling.step import StepTransaction
from cbcore.sim.executor import sim_engine
from cbcore.sim.profile import load_profile
from cbcore.testing.fake_run import FakeRun

TIGHT = {
    "kv_cache": {"block_size": 4, "num_blocks": 24, "prefix_caching": True},
    "scheduler": {"budget": {"name": "token-budget", "max_num_seqs": 4, "max_num_batched_tokens": 48}},
}


def engine(data: dict | None = None) -> EngineCore:
    return sim_engine(EngineConfig.model_validate(data or TIGHT), load_profile("h200-llama-3-8b"), VirtualClock())


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts with shared heads (prefix-cache hits) and lengths that force preemptions in TIGHT."""
    rng = random.Random(seed)
    heads = [[rng.randrange(1, 5000) for _ in range(8)] for _ in range(3)]
    return [rng.choice(heads) + [rng.randrange(1, 5000) for _ in range(rng.randrange(1, 30))] for _ in range(n)]


def record(eng: EngineCore) -> list[tuple]:
    steps: list[tuple] = []

    def listen(rec: StepRecord) -> None:
        out = rec.output
        steps.append((tuple((s.seq.request_id, s.num_tokens) for s in out.scheduled),
                      tuple(s.request_id for s in out.preempted), rec.stats.prefix_cache_hits_tokens))  # fmt: skip

    eng.step_listeners.append(listen)
    return steps


def test_an_array_prompt_runs_step_for_step_as_the_same_list_prompt():
    runs = []
    for as_array in (False, True):
        eng = engine()
        steps = record(eng)
        for i, ids in enumerate(prompts(12)):
            eng.add_request(array("i", ids) if as_array else ids, SamplingParams(max_new_tokens=8 + i % 9),
                            request_id=f"r{i}")  # fmt: skip
        outs = {}
        while eng.has_unfinished():
            outs.update((o.request_id, o) for o in eng.step() if o.finished)
        runs.append((steps, {k: (list(o.prompt_token_ids), list(o.output_token_ids), o.metrics) for k, o in outs.items()}))
    assert any(preempted for _, preempted, _ in runs[0][0]), "the scenario must preempt"
    assert any(hits for _, _, hits in runs[0][0]), "the scenario must hit the prefix cache"
    assert runs[0] == runs[1]


def test_an_array_prompt_is_held_once_as_the_token_array_and_read_back_as_its_ids():
    eng = engine()
    ids = array("i", [7, 8, 9, 10, 11])
    eng.add_request(ids, SamplingParams(max_new_tokens=2), request_id="a")
    ids[0] = 99  # the caller's array is not the engine's
    seq = eng.requests["a"]
    assert isinstance(seq.token_ids, array) and isinstance(seq.prompt_token_ids, Prefix)
    assert list(seq.prompt_token_ids) == [7, 8, 9, 10, 11] and seq.prompt_token_ids[1:3] == array("i", [8, 9])
    assert seq.view.prompt_token_ids is seq.prompt_token_ids and seq.view.num_prompt_tokens == 5
    while eng.has_unfinished():
        eng.step()
    assert list(seq.prompt_token_ids) == [7, 8, 9, 10, 11] and seq.num_output_tokens == 2  # the outputs went after


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        (array("i", [3, -1, 4]), "token id -1 is outside the vocabulary"),
        (array("i", [3, 128256, 4]), "token id 128256 is outside the vocabulary"),
        (array("d", [1.0, 2.0]), "a prompt is a string, a list of int token ids or an array"),
        (array("i"), "the prompt is empty"),
    ],
)
def test_a_bad_array_prompt_is_refused_by_name(prompt, match):
    with pytest.raises(RequestError, match=match):
        engine().add_request(prompt, SamplingParams(max_new_tokens=2), request_id="bad")


def test_a_synthetic_prompt_is_drawn_straight_into_the_array_the_list_would_give():
    prompt = PromptIds(SyntheticPrompt(tokens=700, seed=3, row=5, vocab_size=32000, special_ids=(0, 1, 2)))
    drawn = prompt.array()
    assert drawn.typecode == "i" and drawn.tolist() == list(prompt)


def test_a_queue_of_stored_keys_is_always_in_the_order_a_sort_would_give():
    """Priority without aging stores its keys: the queue is kept sorted (after equal keys) as requests
    arrive and are preempted, and is what the door's sort of it returns, step after step."""
    run = FakeRun(Priority(), num_blocks=12)
    rng = random.Random(1)
    for i in range(40):
        if i % 2 == 0:
            for j in range(rng.randrange(0, 4)):
                run.add(f"r{i}-{j}", rng.randrange(4, 20), max_new=rng.randrange(4, 12), priority=rng.randrange(3))
        run.step()
        waiting = run.sched.waiting
        assert waiting == sorted(waiting, key=lambda s: s.queue_key)
    assert run.sched.num_preemptions > 0, "the scenario must preempt (a preempted request re-joins the queue)"


def test_an_undone_step_on_a_clock_that_stood_still_restores_the_admission_stamps(monkeypatch):
    """The transaction tells this step's first-admission stamps apart by the clock; when the clock has not
    moved since the last step was planned, it records every waiting sequence instead, as before."""
    eng = engine()
    for i, ids in enumerate(prompts(6, seed=2)):
        eng.add_request(ids, SamplingParams(max_new_tokens=4), request_id=f"r{i}")
    eng.step()  # planned at 0.0; the clock advances by the step's cost
    quick: list[bool] = []
    real_init = StepTransaction.__init__

    def spy(self, steps, live):
        real_init(self, steps, live)
        quick.append(self.idle is None)

    monkeypatch.setattr(StepTransaction, "__init__", spy)
    for stood_still in (False, True):
        if stood_still:
            eng.steps.planned = eng.clock()  # as after a step that computed nothing (no cost, no time)
        before = {rid: (s.first_scheduled_time, s.status, s.num_computed_tokens) for rid, s in eng.requests.items()}
        real = eng.executor.forward

        def fails(prepared, real=real):
            monkeypatch.setattr(eng.executor, "forward", real)
            real(prepared)
            raise RuntimeError("device lost")

        monkeypatch.setattr(eng.executor, "forward", fails)
        with pytest.raises(RuntimeError, match="device lost"):
            eng.step()
        after = {rid: (s.first_scheduled_time, s.status, s.num_computed_tokens) for rid, s in eng.requests.items()}
        assert after == before
        assert any(t is None for t, _, _ in before.values()), "some request must still wait for its first admission"
    assert quick == [True, False]


def test_a_long_run_frees_its_ended_requests_as_it_goes():
    """An ended sequence and its view keep each other alive; the driver collects them every 512
    ended requests, so a run holds about its live requests, not every one it has served."""
    n = 1200
    rng = random.Random(4)
    reqs = [BenchRequest(request_id=f"r{i}", arrival_s=0.0, max_new_tokens=2, ignore_eos=True,
                         synthetic_prompt=SyntheticPrompt(tokens=rng.randrange(4, 40), row=i, vocab_size=32000))
            for i in range(n)]  # fmt: skip
    workload = Workload("many", tuple(reqs))
    eng = engine({"scheduler": {"budget": {"name": "token-budget", "max_num_seqs": 8}}})  # all wait: they grow old
    alive: list[int] = []

    def count(rec: StepRecord) -> None:
        if rec.stats.step % 300 == 0:
            alive.append(sum(type(o) is Sequence for o in gc.get_objects()))

    eng.step_listeners.append(count)
    run = drive([eng], "many", workload, [PromptIds(r.synthetic_prompt) for r in reqs])
    assert len(run.outputs) == n and all(o.finish_reason == "length" for o in run.outputs)
    assert alive and max(alive) < 512 + 200, alive
    assert all(isinstance(o.prompt_token_ids, PromptIds) and type(o.output_token_ids) is list for o in run.outputs)
