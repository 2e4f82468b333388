"""No plugin and no input makes the engine lie, hang or lose work: one test per known way it used to.

The misbehaving plugins below are loaded by path (``this_file.py:Class``), as
a user's plugin file would be; each can be switched to behave again
(``broken = False``) to show the engine is reusable after the error.
"""

from __future__ import annotations

import signal

import pytest
from pydantic import ValidationError
from support import CAPS, PROMPTS

from cbcore import (
    Engine,
    EngineConfig,
    QueuePolicy,
    RequestError,
    SamplingParams,
    SchedulerError,
    SchedulerStall,
)
from cbcore.policies import FCFS, ChunkedPrefill, Recompute, TokenBudget
from cbcore.policies.preemption import PreemptionParams
from cbcore.scheduling.scheduler import ScheduledSeq, SchedulerOutput, SchedulerPlugin
from cbcore.scheduling.sequence import SequenceStatus
from cbcore.testing import assert_equivalent, compare_greedy, reference_generate
from cbcore.testing.block_invariants import check_blocks

HERE = __file__
EAGER = {"name": "eager"}
SMALL = [0, 2, 4, 7, 14]  # prompts whose caps are short: 1, 17, 5, 2, 8 tokens


def engine_for(lm, scheduler=None, kv=None, **extra) -> Engine:
    config = {"backend": EAGER, "kv_cache": kv or {"block_size": 4, "num_blocks": 64}, **extra}
    if scheduler:
        config["scheduler"] = scheduler
    return Engine(lm, config=EngineConfig.model_validate(config))


def path(cls: str) -> dict:
    return {"name": f"{HERE}:{cls}"}


def assert_clean(engine: Engine) -> None:
    """Block bookkeeping is consistent, and after aborting everything no block is held."""
    sched = engine.scheduler
    live = list(getattr(sched, "running", []))  # the sequences holding device blocks
    check_blocks(sched.blocks, live)
    for rid in list(engine._live):
        engine.abort(rid)
    assert not engine.has_unfinished()
    check_blocks(sched.blocks, [])
    assert sched.blocks.num_free_blocks == sched.blocks.num_blocks


def run_exact(engine: Engine, model, idx=SMALL) -> None:
    prompts = [PROMPTS[i] for i in idx]
    caps = [CAPS[i] for i in idx]
    outs = engine.generate(prompts, [SamplingParams(max_new_tokens=c) for c in caps])
    assert_equivalent(compare_greedy(model, outs, reference_generate(model, prompts, caps)))


# -- misbehaving plugins -------------------------------------------------------------------------


class OrderTwice(QueuePolicy):
    name = "order-twice"
    broken = True

    def key(self, seq, now):
        return (seq.arrival_time, seq.request_id)

    def order(self, seqs, now):
        ordered = sorted(seqs, key=lambda s: self.key(s, now))
        return ordered + ordered[:1] if self.broken and ordered else ordered


class AlwaysOutranks(FCFS):
    name = "always-outranks"

    def outranks(self, a, b, now):
        return True


class IgnoresTokensLeft(ChunkedPrefill):
    name = "ignores-tokens-left"
    broken = True

    def num_tokens(self, seq, tokens_left, scheduled):
        return seq.num_pending_tokens if self.broken else super().num_tokens(seq, tokens_left, scheduled)


class FailsAtStepEnd(FCFS):
    name = "fails-at-step-end"
    broken = True

    def on_step_end(self, results, now):
        if self.broken and any(r.seq.num_output_tokens == 3 for r in results):
            raise RuntimeError("bookkeeping bug")


class InterruptedAtStepEnd(FCFS):
    name = "interrupted-at-step-end"
    broken = True

    def on_step_end(self, results, now):
        if self.broken and any(r.seq.num_output_tokens == 3 for r in results):
            raise KeyboardInterrupt  # Ctrl-C landing while the policy runs


class KeyFails(FCFS):
    name = "key-fails"
    broken = True

    def key(self, seq, now):
        if self.broken and seq.request_id == "bad":
            raise KeyError("no key for you")
        return super().key(seq, now)


BAD = "bad"  # the request every Flaky* policy fails on, in the method named by its ``fail_in``


def _about_bad(fail_in: str, method: str, *seqs) -> None:
    if fail_in == method and any(s.request_id == BAD for s in seqs):
        raise ValueError(f"{method} failed")


class Flaky(FCFS):
    """Raises in the method named by ``fail_in`` (queue kind), for the request ``bad`` only."""

    name = "flaky-queue"
    fail_in = ""

    def key(self, seq, now):
        _about_bad(self.fail_in, "key", seq)
        return super().key(seq, now)

    def on_arrival(self, seq, now):
        _about_bad(self.fail_in, "on_arrival", seq)

    def on_step_end(self, results, now):
        _about_bad(self.fail_in, "on_step_end", *(r.seq for r in results))

    def on_finish(self, seq, now):
        _about_bad(self.fail_in, "on_finish", seq)


class FlakyOrder(Flaky):
    """The same, with an order of its own (asked with every waiting sequence at once)."""

    name = "flaky-order"
    _fixed_keys = False

    def order(self, seqs, now):
        _about_bad(self.fail_in, "order", *seqs)
        return sorted(seqs, key=lambda s: (s.arrival_time, s.request_id))


class FlakyBudget(TokenBudget):
    name = "flaky-budget"
    fail_in = ""

    def limits(self, state):
        _about_bad(self.fail_in, "limits", *state.waiting)
        return super().limits(state)

    def may_admit(self, seq, state):
        _about_bad(self.fail_in, "may_admit", seq)
        return True


class FlakyPrefill(ChunkedPrefill):
    name = "flaky-prefill"
    fail_in = ""

    def num_tokens(self, seq, tokens_left, scheduled):
        _about_bad(self.fail_in, "num_tokens", seq)
        return super().num_tokens(seq, tokens_left, scheduled)


class FlakyPreemption(Recompute):
    name = "flaky-preemption"
    fail_in = ""

    def choose_victim(self, candidates, queue, now):
        _about_bad(self.fail_in, "choose_victim", *candidates)
        return super().choose_victim(candidates, queue, now)


class Lazy(SchedulerPlugin):
    """A whole scheduler that accepts requests and never plans anything."""

    name = "lazy"

    def __init__(self, params, blocks):
        super().__init__(params, blocks)
        self.seqs = {}

    def add(self, seq):
        self.seqs[seq.request_id] = seq

    def schedule(self):
        return SchedulerOutput()

    def on_step_end(self, output, results):
        pass

    def abort(self, request_id):
        return self.seqs.pop(request_id, None)



class Twice(Lazy):
    """Schedules its first request twice in one step."""

    name = "twice"

    def schedule(self):
        if not self.seqs:
            return SchedulerOutput()
        seq = next(iter(self.seqs.values()))
        seq.status = SequenceStatus.RUNNING
        self.blocks.grow(seq, seq.num_pending_tokens)
        return SchedulerOutput(scheduled=[ScheduledSeq(seq, 1), ScheduledSeq(seq, 1)])


# -- the table's rows ----------------------------------------------------------------------------


def test_tiny_temperature_is_greedy_and_loses_nobody(models):
    model = models["llama"]
    engine = engine_for(model)
    prompts = [PROMPTS[i] for i in SMALL]
    params = [SamplingParams(max_new_tokens=CAPS[i], temperature=1e-38 if i == 2 else 0.0) for i in SMALL]
    outs = engine.generate(prompts, params)
    assert_equivalent(compare_greedy(model, outs, reference_generate(model, prompts, [CAPS[i] for i in SMALL])))
    assert not engine.has_unfinished()


def test_a_sampling_failure_fails_only_its_request(models, monkeypatch):
    import cbcore.execution.sampler as sampler

    real = sampler._sample_row

    def failing(row, temperature, top_k, top_p, generator):
        if temperature == 0.5:
            raise RuntimeError("probability tensor contains inf/nan")
        return real(row, temperature, top_k, top_p, generator)

    monkeypatch.setattr(sampler, "_sample_row", failing)
    model = models["llama"]
    engine = engine_for(model)
    prompts = [PROMPTS[i] for i in SMALL]
    params = [SamplingParams(max_new_tokens=CAPS[i]) for i in SMALL]
    params[1] = SamplingParams(max_new_tokens=5, temperature=0.5, seed=1)
    outs = engine.generate(prompts, params)
    assert outs[1].finish_reason == "error" and "sampling failed" in outs[1].error
    rest = [o for i, o in enumerate(outs) if i != 1]
    ids = [p for i, p in enumerate(prompts) if i != 1]
    caps = [p.max_new_tokens for i, p in enumerate(params) if i != 1]
    assert_equivalent(compare_greedy(model, rest, reference_generate(model, ids, caps)))
    assert_clean(engine)


def test_seed_range_and_a_rejected_request_leave_generate_reusable(models):
    with pytest.raises(ValidationError, match="seed"):
        SamplingParams(seed=2**64, temperature=1.0)
    with pytest.raises(ValidationError, match="seed"):
        SamplingParams(seed=-1, temperature=1.0)
    SamplingParams(seed=2**64 - 1, temperature=1.0)
    model = models["llama"]
    engine = engine_for(model)
    outs = engine.generate([[1, 2], [3, 4]], [SamplingParams(stop_token_ids=[10_000]), SamplingParams()])
    assert outs[0].finish_reason == "error" and "stop token id 10000 is outside the vocabulary" in outs[0].error
    assert outs[1].finish_reason == "length" and not engine.has_unfinished()
    run_exact(engine, model)


def test_a_queue_that_orders_a_sequence_twice_is_stopped_by_name(models):
    model = models["llama"]
    engine = engine_for(model, {"queue": path("OrderTwice")})
    with pytest.raises(SchedulerError, match=r"queue policy 'order-twice' \(path .*test_robustness.py:OrderTwice\)") as err:
        engine.generate([PROMPTS[i] for i in SMALL], SamplingParams(max_new_tokens=6))
    assert err.value.rule == "order() returns each given sequence exactly once"
    assert "appears 2 times" in str(err.value)
    assert not engine.has_unfinished()  # generate() aborted its own requests
    engine.scheduler.door.queue.broken = False
    run_exact(engine, model)
    assert_clean(engine)


def test_a_whole_scheduler_that_schedules_twice_ends_that_request_before_it_runs(models):
    engine = engine_for(models["llama"], {"name": f"{HERE}:Twice"})
    engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=6), request_id="a")
    (out,) = engine.step()  # refused before running; the step is planned again without "a"
    assert (out.request_id, out.finish_reason, out.output_token_ids) == ("a", "error", [])
    assert out.error == "scheduler 'twice' broke the rule 'each sequence is scheduled at most once'"
    assert not engine.has_unfinished()
    assert engine.scheduler.blocks.num_free_blocks == engine.scheduler.blocks.num_blocks  # undone


def test_a_whole_scheduler_that_plans_nothing_stalls_at_once(models):
    engine = engine_for(models["llama"], {"name": f"{HERE}:Lazy"})
    engine.add_request([1, 2, 3])
    with pytest.raises(SchedulerStall, match=r"scheduler 'lazy' \(path .*\) planned no tokens while work waits"):
        engine.step()


def test_a_preemption_livelock_stalls_within_bounded_steps(models):
    engine = engine_for(
        models["llama"],
        {
            "queue": path("AlwaysOutranks"),
            "budget": {"name": "token-budget", "max_num_seqs": 1, "max_num_batched_tokens": 8},
            "prefill": {"name": "chunked-prefill", "chunk_size": 4},
        },
        kv={"block_size": 4, "num_blocks": 16},
    )
    engine.add_request([5] * 40, SamplingParams(max_new_tokens=4))
    engine.add_request([6] * 40, SamplingParams(max_new_tokens=4))
    steps = 0
    with pytest.raises(SchedulerStall, match=r"always-outranks.*a livelock") as err:
        while engine.has_unfinished():
            steps += 1
            engine.step()
    assert err.value.rule == "preemptions do not undo all progress"
    assert steps <= 4 * 64 // 4 + 4  # the window (4x the cache's 64 tokens) at 4 tokens a step, + the first
    assert_clean(engine)


def test_a_prefill_policy_that_ignores_tokens_left_costs_only_the_request_it_overran(models):
    model = models["llama"]
    budget = {"name": "token-budget", "max_num_seqs": 4, "max_num_batched_tokens": 8}
    engine = engine_for(model, {"prefill": path("IgnoresTokensLeft"), "budget": budget})
    engine.add_request([5] * 5, SamplingParams(max_new_tokens=4), request_id="a")
    engine.add_request([6] * 16, request_id="b")
    outs = engine.step()
    (b,) = [o for o in outs if o.request_id == "b"]
    assert b.finish_reason == "error" and "within tokens_left" in b.error and "ignores-tokens-left" in b.error
    engine.scheduler.door.prefill.broken = False
    final = [o for _ in range(8) for o in engine.step() if o.finished]
    assert final[0].output_token_ids == reference_generate(model, [[5] * 5], [4])[0].token_ids
    run_exact(engine, model)


def test_on_step_end_raising_ends_its_request_after_the_step_it_concerned(models):
    model = models["llama"]
    engine = engine_for(model, {"queue": path("FailsAtStepEnd")})
    rid = engine.add_request(PROMPTS[0][:6], SamplingParams(max_new_tokens=4))
    finals = [o for _ in range(10) for o in engine.step() if o.finished]
    (final,) = finals  # events run after the commit: the third token stands, nothing is planned again
    assert final.request_id == rid and final.finish_reason == "error"
    assert final.error == "queue policy 'fails-at-step-end' raised RuntimeError in on_step_end()"
    assert final.output_token_ids == reference_generate(model, [PROMPTS[0][:6]], [3])[0].token_ids
    assert_clean(engine)


@pytest.fixture
def python_ctrl_c():
    """Python's own Ctrl-C handler, as in a plain ``python`` process (door.interrupted reads it): a process
    a shell starts in the background inherits SIGINT ignored, and Python then installs none."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_a_ctrl_c_inside_a_policy_undoes_the_step_and_stays_a_ctrl_c(models, python_ctrl_c):
    model = models["llama"]
    engine = engine_for(model, {"queue": path("InterruptedAtStepEnd")})
    rid = engine.add_request(PROMPTS[0][:6], SamplingParams(max_new_tokens=3))
    with pytest.raises(KeyboardInterrupt) as caught:  # not a SchedulerError blaming the policy
        for _ in range(10):
            engine.step()
    assert caught.type is KeyboardInterrupt
    assert engine._live[rid].num_output_tokens == 2  # the third token was taken back
    engine.scheduler.door.queue.broken = False
    final = [o for _ in range(3) for o in engine.step() if o.finished]
    assert final[0].output_token_ids == reference_generate(model, [PROMPTS[0][:6]], [3])[0].token_ids
    assert_clean(engine)


def test_a_key_that_raises_in_add_registers_nothing(models):
    engine = engine_for(models["llama"], {"queue": path("KeyFails")})
    with pytest.raises(SchedulerError, match=r"key-fails.*raised in key\(\) for request 'bad'"):
        engine.add_request([1, 2], request_id="bad")
    assert not engine.has_unfinished() and engine.scheduler.get("bad") is None
    assert not engine.abort("bad")
    engine.scheduler.door.queue.broken = False
    engine.add_request([1, 2], request_id="bad")  # the id is free again
    assert engine.abort("bad")
    assert_clean(engine)


FLAKY = [
    ("queue", "Flaky", "key"),
    ("queue", "Flaky", "on_arrival"),
    ("queue", "Flaky", "on_step_end"),
    ("queue", "FlakyOrder", "order"),
    ("budget", "FlakyBudget", "may_admit"),
    ("prefill", "FlakyPrefill", "num_tokens"),
    ("preemption", "FlakyPreemption", "choose_victim"),
]


@pytest.mark.parametrize(("slot", "cls", "method"), FLAKY, ids=[m for _, _, m in FLAKY])
def test_a_policy_failing_on_one_request_costs_only_that_request(models, slot, cls, method):
    model = models["llama"]
    engine = engine_for(model, {slot: path(cls)}, kv={"block_size": 4, "num_blocks": 12})
    policy = getattr(engine.scheduler.door, slot)
    idx = [1, 3, 5, 9]  # long outputs in a small cache: preemptions happen
    prompts = [PROMPTS[i][:12] for i in idx]
    policy.fail_in = method
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=20), request_id=rid)
           for p, rid in zip(prompts, ["r0", BAD, "r2", "r3"], strict=True)] if method not in ("key", "on_arrival") else []  # fmt: skip
    if not ids:  # asked when the request arrives: it is refused, with the plugin named
        with pytest.raises(SchedulerError, match=rf"{policy.name}.*raised in {method}\(\) for request 'bad'"):
            engine.add_request(prompts[1], SamplingParams(max_new_tokens=20), request_id=BAD)
        ids = [engine.add_request(p, SamplingParams(max_new_tokens=20), request_id=rid)
               for p, rid in zip(prompts, ["r0", "ok", "r2", "r3"], strict=True)]  # fmt: skip
    done = {o.request_id: o for _ in range(400) if engine.has_unfinished() for o in engine.step() if o.finished}
    if BAD in done:
        bad = done.pop(BAD)
        assert bad.finish_reason == "error" and bad.error == f"{slot} policy '{policy.name}' raised ValueError in {method}()"
    assert method in ("key", "on_arrival") or BAD in ids
    outs = [done[rid] for rid in ids if rid != BAD]
    kept = [p for p, rid in zip(prompts, ids, strict=True) if rid != BAD]
    assert_equivalent(compare_greedy(model, outs, reference_generate(model, kept, 20)))
    assert engine.scheduler.num_preemptions > 0 or method != "choose_victim"
    assert_clean(engine)


def test_a_failure_that_concerns_no_single_request_stops_the_engine_by_name(models):
    engine = engine_for(models["llama"], {"budget": path("FlakyBudget")})
    engine.scheduler.door.budget.fail_in = "limits"
    engine.add_request(PROMPTS[1][:12], SamplingParams(max_new_tokens=4), request_id=BAD)
    with pytest.raises(SchedulerError, match=r"budget policy 'flaky-budget' \(path .*\) raised in limits\(\)") as err:
        engine.step()
    assert err.value.request_id is None and err.value.rule == "limits() raised"
    assert_clean(engine)


def test_a_failing_on_finish_is_logged_and_the_request_keeps_its_result(models):
    model = models["llama"]
    engine = engine_for(model, {"queue": path("Flaky")})
    engine.scheduler.door.queue.fail_in = "on_finish"
    outs = engine.generate([PROMPTS[1][:12], PROMPTS[3][:12]], SamplingParams(max_new_tokens=5))
    refs = reference_generate(model, [PROMPTS[1][:12], PROMPTS[3][:12]], 5)
    assert_equivalent(compare_greedy(model, outs, refs))
    assert_clean(engine)


def test_max_model_len_beyond_the_model_is_refused_at_start(models):
    with pytest.raises(ValueError, match="max_model_len is 5000 but the model has only 512 positions"):
        engine_for(models["gpt2"], model={"max_model_len": 5000})


def test_a_request_that_can_never_fit_is_refused_at_add(models):
    engine = engine_for(models["llama"], kv={"block_size": 4, "num_blocks": 8})  # 32 tokens
    with pytest.raises(RequestError, match=r"20 tokens \+ max_new_tokens 30 needs KV for 49 tokens.*holds 32"):
        engine.add_request([5] * 20, SamplingParams(max_new_tokens=30))
    engine.add_request([5] * 20, SamplingParams(max_new_tokens=13))  # 32 tokens of KV: fits exactly
    gpt2 = engine_for(models["gpt2"], kv={"block_size": 16, "num_blocks": 64})
    with pytest.raises(RequestError, match=r"exceed the model's context of 512 tokens; lower max_new_tokens to 12"):
        gpt2.add_request([5] * 500, SamplingParams(max_new_tokens=13))
    assert not gpt2.has_unfinished()


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: SamplingParams(max_new_tokens="5"), "max_new_tokens"),
        (lambda: SamplingParams(temperature=True), "temperature"),
        (lambda: SamplingParams(ignore_eos="yes"), "ignore_eos"),
        (lambda: SamplingParams(temperature=float("nan")), "temperature"),
        (lambda: SamplingParams(temperature=float("inf")), "temperature"),
        (lambda: SamplingParams(temperature=101.0), "temperature"),
        (lambda: SamplingParams(stop_token_ids=["3"]), "stop_token_ids"),
        (lambda: EngineConfig.model_validate({"kv_cache": {"block_size": "16"}}), "block_size"),
        (lambda: EngineConfig.model_validate({"model": {"trust_remote_code": "yes"}}), "trust_remote_code"),
        (
            lambda: EngineConfig.model_validate({"scheduler": {"budget": {"name": "token-budget", "max_num_seqs": "4"}}}),
            "max_num_seqs",
        ),
    ],
)
def test_loose_types_are_refused(make, field):
    with pytest.raises((ValidationError, ValueError), match=field):
        make()


class TeleportParams(PreemptionParams):
    mode: str = "teleport"  # type: ignore[assignment]


class Teleport(Recompute):
    name = "teleport"
    Params = TeleportParams


def test_an_unknown_preemption_mode_is_refused_at_start(models):
    with pytest.raises(ValueError, match=r"preemption policy 'teleport'.*mode must be 'recompute' or 'swap'"):
        engine_for(models["llama"], {"preemption": path("Teleport")})
