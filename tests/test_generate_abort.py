"""``generate()`` with a request aborted from a step listener: it comes back as an abort, not a KeyError.

A step listener (a benchmark's watchdog, a test's probe) may call
``engine.abort`` on one of the call's own requests; the engine produces no
output for an aborted request, so ``generate()`` must end it itself.
"""

from __future__ import annotations

from support import CAPS, PROMPTS

from cbcore import Engine, EngineConfig, SamplingParams

KV = {"block_size": 4, "num_blocks": 256}


def engine(models) -> Engine:
    return Engine(models["llama"], config=EngineConfig.model_validate({"kv_cache": KV}))


def test_request_aborted_by_a_step_listener_returns_as_abort(models):
    prompts, caps = PROMPTS[:4], [40, 40, 40, 40]
    params = [SamplingParams(max_new_tokens=c, ignore_eos=True) for c in caps]
    eng = engine(models)
    want = [o.output_token_ids for o in eng.generate(prompts, params)]
    victim, seen = "", {}

    def abort_after_three(record) -> None:
        nonlocal victim
        for out in record.outputs:
            seen[out.request_id] = len(out.output_token_ids)
        ids = sorted(seen)
        if not victim and ids and seen[ids[1]] >= 3:
            victim = ids[1]
            assert eng.abort(victim)

    eng.step_listeners.append(abort_after_three)
    outs = eng.generate(prompts, params)
    eng.step_listeners.remove(abort_after_three)
    assert [o.request_id for o in outs][1] == victim
    got = outs[1]
    assert (got.finished, got.finish_reason, got.error) == (True, "abort", None)
    assert got.prompt_token_ids == prompts[1]
    assert 3 <= len(got.output_token_ids) < 40 and got.output_token_ids == want[1][: len(got.output_token_ids)]
    for i in (0, 2, 3):
        assert (outs[i].finish_reason, outs[i].output_token_ids) == ("length", want[i])
    assert not eng.has_unfinished()


def test_request_aborted_before_its_first_token_returns_as_abort_with_its_prompt(models):
    prompts = [PROMPTS[0], PROMPTS[5]]
    config = {"kv_cache": KV, "scheduler": {"budget": {"max_num_seqs": 1}}}  # the second waits its turn
    eng = Engine(models["llama"], config=EngineConfig.model_validate(config))
    first = eng.new_request_id()  # ids are handed out in order: generate() takes the next two
    number = int(first.rsplit("-", 1)[1])
    waiting = f"req-{number + 2}"
    fired = []

    def abort_the_waiting_one(record) -> None:
        if not fired:
            assert waiting not in {s.seq.request_id for s in record.output.scheduled}
            fired.append(eng.abort(waiting))

    eng.step_listeners.append(abort_the_waiting_one)
    outs = eng.generate(prompts, SamplingParams(max_new_tokens=CAPS[1]))
    assert fired == [True] and outs[1].request_id == waiting
    assert (outs[1].finish_reason, outs[1].prompt_token_ids, outs[1].output_token_ids) == ("abort", prompts[1], [])
    assert outs[0].finish_reason in ("stop", "length") and outs[0].output_token_ids
