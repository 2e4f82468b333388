"""Admission and planning rules checked on every step of real engine runs.

* ``max_num_seqs`` bounds both the sequences of a step and the running ones, in every
  phase order (decode-first and prefill-first) with whole prompts and with chunks, and
  with swap preemption bringing sequences back.
* A preempted request keeps the time it was first admitted.
* A prefill policy may answer more tokens than are pending: that means all of them.
"""

from __future__ import annotations

import pytest
from support import PROMPTS

from cbcore import Engine, EngineConfig, SamplingParams
from cbcore.policies import ChunkedPrefill
from cbcore.testing import assert_equivalent, compare_greedy, reference_generate

HERE = __file__
IDX = [0, 2, 4, 5, 7, 9, 10, 12, 14, 15]  # prompts of 1 to 64 tokens
CAP = 6


class StepClock:
    """The step's number as the time: an admission's time says in which step it happened."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run(model, scheduler: dict, kv: dict | None = None, listen=None, idx=IDX, cap=CAP):
    """Run the prompts to the end (listening to every step); outputs checked token-exact."""
    kv = kv or {"block_size": 4, "num_blocks": 256}
    config = EngineConfig.model_validate(
        {"backend": {"name": "eager"}, "kv_cache": kv, "scheduler": scheduler}
    )
    clock = StepClock()
    engine = Engine(model, config=config, clock=clock)

    def tick(record) -> None:
        if listen is not None:
            listen(engine, record)
        clock.now += 1.0

    engine.step_listeners.append(tick)
    prompts = [PROMPTS[i] for i in idx]
    outs = engine.generate(prompts, [SamplingParams(max_new_tokens=cap, ignore_eos=True)] * len(prompts))
    assert_equivalent(compare_greedy(model, outs, reference_generate(model, prompts, [cap] * len(prompts))))
    return engine, outs


PREFILLS = {  # (the prefill policy, the scheduler's phase order)
    "whole-decode-first": ({"name": "whole-prompt"}, "decode-first"),
    "whole-prefill-first": ({"name": "whole-prompt"}, "prefill-first"),
    "chunked-decode-first": ({"name": "chunked-prefill", "chunk_size": 8}, "decode-first"),
    "chunked-prefill-first": ({"name": "chunked-prefill", "chunk_size": 8}, "prefill-first"),
}


@pytest.mark.parametrize("swap", [False, True], ids=["roomy", "swapping"])
@pytest.mark.parametrize("prefill", sorted(PREFILLS))
def test_max_num_seqs_bounds_every_step_and_the_running_set_in_every_phase_order(models, prefill, swap):
    limit = 3
    scheduler = {
        "prefill": PREFILLS[prefill][0],
        "order": PREFILLS[prefill][1],
        "budget": {"name": "token-budget", "max_num_seqs": limit, "max_num_batched_tokens": 64},
    }
    kv = {"block_size": 4, "num_blocks": 256}
    if swap:  # tight: decodes outgrow the cache, victims are swapped out and come back
        scheduler["preemption"] = {"name": "swap"}
        kv = {"block_size": 4, "num_blocks": 24}
    seen: list[tuple[int, int]] = []

    def listen(engine, record) -> None:
        running = len(engine.scheduler.running)
        assert record.stats.num_seqs <= limit and running <= limit, (record.stats, running)
        seen.append((record.stats.num_seqs, running))

    engine, _ = run(models["llama"], scheduler, kv, listen)
    assert max(n for n, _ in seen) == limit  # the limit was reached, so it was tested
    if swap:
        assert engine.step_totals.preemptions > 0


def test_a_preempted_request_keeps_the_time_of_its_first_admission(models):
    """Recompute preemption sends requests back to wait; their metrics keep the step they first ran in."""
    first_run: dict[str, float] = {}
    preempted: set[str] = set()

    def listen(engine, record) -> None:
        for item in record.output.scheduled:
            first_run.setdefault(item.seq.request_id, engine.clock())
        preempted.update(seq.request_id for seq in record.output.preempted)

    scheduler = {"budget": {"name": "token-budget", "max_num_seqs": 6, "max_num_batched_tokens": 64}}
    _, outs = run(models["llama"], scheduler, {"block_size": 4, "num_blocks": 20}, listen, cap=16)
    assert preempted, "the cache was meant to be too small for every request at once"
    readmitted = [o for o in outs if o.request_id in preempted and o.metrics.num_preemptions]
    assert readmitted
    for out in outs:
        assert out.metrics.first_scheduled_time == first_run[out.request_id], out.request_id


class AllOfIt(ChunkedPrefill):
    """Answers every token the step has left (any number when the step is empty): more than is pending."""

    name = "all-of-it"

    def num_tokens(self, seq, tokens_left, scheduled):
        return 10**9 if not scheduled else tokens_left


def test_a_prefill_policy_answering_more_than_is_pending_runs_the_whole_prompt(models):
    chunks: list[tuple[str, int, int]] = []

    def listen(engine, record) -> None:
        chunks.extend(
            (s.seq.request_id, s.num_tokens, s.seq.num_prompt_tokens)
            for s in record.output.scheduled
            if s.num_tokens > 1 or s.seq.num_output_tokens == 1  # a prompt (its first token was just sampled)
        )

    scheduler = {
        "prefill": {"name": f"{HERE}:AllOfIt"},
        "budget": {"name": "token-budget", "max_num_seqs": 4, "max_num_batched_tokens": 512},
    }
    run(
        models["llama"], scheduler, listen=listen
    )  # 4 prompts of at most 64 tokens: the budget always has more
    assert len(chunks) == len(IDX)  # one prefill per prompt, nothing recomputed
    assert all(n == prompt for _, n, prompt in chunks), chunks
