"""The scheduler's counters and its admission loop at their edges, on the fake model (no model, milliseconds).

Counters are public (metrics read them): each event is counted once, and a
partial prefill taken back by a preemption in the same step is not counted.
A request the budget refuses is the budget's choice, not a lack of room:
the requests behind it are still admitted in that step.
"""

from __future__ import annotations

import pytest

from cbcore.policies import FCFS, ChunkedPrefill, Priority, Recompute, Swap, TokenBudget, WholePrompt
from cbcore.policies.chunked_prefill import ChunkedPrefillParams
from cbcore.policies.token_budget import TokenBudgetParams
from cbcore.scheduling.scheduler import SchedulerStall
from cbcore.scheduling.sequence import SequenceStatus
from cbcore.testing.fake_run import FakeRun, budget


class RefusingBudget(TokenBudget):
    """A token budget that never admits the requests named in ``refused``."""

    name = "refusing-budget"

    def __init__(self, refused: set[str]) -> None:
        super().__init__(TokenBudgetParams(max_num_seqs=8, max_num_batched_tokens=256))
        self.refused = refused

    def may_admit(self, seq, state) -> bool:
        return seq.request_id not in self.refused and super().may_admit(seq, state)


def test_a_request_the_budget_refuses_does_not_hold_back_those_behind_it() -> None:
    run = FakeRun(FCFS(), RefusingBudget({"b"}), WholePrompt())
    for rid in "abc":
        run.add(rid, prompt_len=4, max_new=2)
    first = run.step()
    assert first.first_time == ["a", "c"]
    assert run.seqs["b"].status is SequenceStatus.WAITING


@pytest.mark.parametrize("prompt", [24, 16], ids=["partial-chunk-taken-back", "final-chunk-taken-back"])
def test_a_prefill_chunk_taken_back_by_a_preemption_in_its_step_is_not_counted(prompt: int) -> None:
    # 5 blocks of 4. "low" runs 8-token chunks; when "urgent" arrives, low's next chunk (partial of 24
    # tokens, or the last of 16) is planned first (phase 1), then urgent, which does not fit, preempts it.
    run = FakeRun(Priority(), budget(4, 64), ChunkedPrefill(ChunkedPrefillParams(chunk_size=8)), num_blocks=5)
    run.add("low", prompt_len=prompt, max_new=2, priority=5)
    run.step()
    run.add("urgent", prompt_len=20, max_new=2, priority=0)
    step = run.step()
    assert [s.request_id for s in step.out.preempted] == ["low"] and step.chunks == [("urgent", 8, False)]
    run.run()
    partial = sum(not final for step in run.steps for _, _, final in step.chunks)
    assert run.sched.num_partial_prefills == partial


def test_a_request_too_big_for_the_whole_cache_fails_and_those_behind_it_are_admitted_in_its_step() -> None:
    run = FakeRun(FCFS(), budget(4, 64), WholePrompt(), num_blocks=4)  # 16 slots
    run.add("huge", prompt_len=40, max_new=2)
    run.add("small", prompt_len=4, max_new=2)
    step = run.step()
    assert [s.request_id for s in step.out.failed] == ["huge"] and step.first_time == ["small"]
    assert run.seqs["huge"].finish_reason.value == "error"
    assert "needs 10 KV blocks for 40 tokens but the cache has 4 blocks of 4" in run.seqs["huge"].error


def test_each_swap_that_falls_back_to_a_recompute_is_counted_once() -> None:
    # Two host blocks: the first victim is swapped out whole or not at all; later ones fall back.
    run = FakeRun(FCFS(), budget(4, 64), WholePrompt(), Swap(), num_blocks=10, block_size=4, host_blocks=2)
    fallbacks = swapped = 0
    for rid, prompt in (("a", 7), ("b", 7), ("c", 7), ("d", 7)):
        run.add(rid, prompt_len=prompt, max_new=12)
    for _ in range(300):
        if not run.sched.has_unfinished():
            break
        record = run.step()
        for seq in record.out.preempted:
            swapped += seq.status is SequenceStatus.SWAPPED
            fallbacks += seq.status is SequenceStatus.WAITING
    assert fallbacks > 0 and run.sched.num_preemptions == fallbacks + swapped
    assert run.sched.num_swap_fallbacks == fallbacks


class Defers(ChunkedPrefill):
    """Chunks of 4, except that it gives the requests named in ``deferred`` no tokens (0: not this step)."""

    name = "defers"

    def __init__(self, deferred: set[str]) -> None:
        super().__init__(ChunkedPrefillParams(chunk_size=4))
        self.deferred = deferred

    def num_tokens(self, seq, tokens_left, scheduled):
        return 0 if seq.request_id in self.deferred else super().num_tokens(seq, tokens_left, scheduled)


@pytest.mark.parametrize(("sits_out", "runs"), [("b", "a"), ("a", "b")], ids=["the-last", "the-first"])
def test_a_running_prompt_given_no_tokens_sits_the_step_out_and_the_others_run(sits_out: str, runs: str) -> None:
    deferred: set[str] = set()
    run = FakeRun(FCFS(), budget(4, 64), Defers(deferred))
    run.add("a", prompt_len=12, max_new=3)
    run.add("b", prompt_len=12, max_new=3)
    run.step()
    deferred.add(sits_out)
    assert [c[0] for c in run.step().chunks] == [runs]
    deferred.clear()
    run.run()
    assert all(s.num_output_tokens == 3 for s in run.seqs.values())


def test_a_waiting_request_given_no_tokens_preempts_nobody_and_stops_admission() -> None:
    deferred = {"urgent"}
    run = FakeRun(Priority(), budget(4, 64), Defers(deferred), num_blocks=4)
    run.add("low", prompt_len=12, max_new=4, priority=5)
    run.step()
    run.add("urgent", prompt_len=8, max_new=2, priority=0)
    run.add("after", prompt_len=1, max_new=1, priority=1)
    step = run.step()
    assert not step.out.preempted and step.first_time == [] and run.sched.num_preemptions == 0


class Recording(Recompute):
    """Recompute that keeps the candidates it is asked to choose among."""

    name = "recording"

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[int] = []

    def choose_victim(self, candidates, queue, now):
        self.asked.append(len(candidates))
        return super().choose_victim(candidates, queue, now)


def test_the_preemption_policy_is_asked_only_when_there_is_a_choice() -> None:
    # 5 blocks of 4, two 8-token prompts (2 blocks each): at their first decode both need a third block;
    # "a" takes the free one, and "b", the only candidate left, is its own victim without asking.
    policy = Recording()
    run = FakeRun(FCFS(), budget(4, 64), WholePrompt(), policy, num_blocks=5)
    run.add("a", prompt_len=8, max_new=6)
    run.add("b", prompt_len=8, max_new=6)
    run.run()
    assert run.sched.num_preemptions > 0
    assert all(n >= 2 for n in policy.asked), policy.asked


def test_an_abort_ends_a_request_as_aborted_or_with_the_error_the_engine_recorded_on_it() -> None:
    run = FakeRun(FCFS(), budget(4, 64), WholePrompt())
    plain, failed = run.add("plain", prompt_len=4), run.add("failed", prompt_len=4)
    run.step()
    failed.error = "the sampler failed on it"
    assert run.sched.abort("plain") is plain and run.sched.abort("failed") is failed
    assert (plain.finish_reason.value, plain.error) == ("abort", None)
    assert (failed.finish_reason.value, failed.error) == ("error", "the sampler failed on it")
    assert run.sched.abort("plain") is None and not run.sched.has_unfinished()


class StepCounting(TokenBudget):
    """A token budget that keeps the step index of every state it is shown."""

    name = "step-counting"

    def __init__(self) -> None:
        super().__init__(TokenBudgetParams(max_num_seqs=4, max_num_batched_tokens=64))
        self.seen: list[int] = []

    def limits(self, state):
        self.seen.append(state.step)
        return super().limits(state)


def test_the_policies_see_the_step_index_count_one_per_step() -> None:
    policy = StepCounting()
    run = FakeRun(FCFS(), policy, WholePrompt())
    run.add("a", prompt_len=4, max_new=3)
    run.run()
    assert policy.seen == [1, 2, 3] and run.sched.step_index == 3


def test_a_running_request_that_outgrows_the_whole_cache_alone_fails_naming_its_size() -> None:
    run = FakeRun(FCFS(), budget(4, 64), WholePrompt(), num_blocks=2)  # 8 slots
    seq = run.add("long", prompt_len=6, max_new=10)
    run.run()
    assert seq.finish_reason.value == "error"
    assert "needs 3 KV blocks for 9 tokens but the cache has 2 blocks of 4" in seq.error


class Narrowing(TokenBudget):
    """(sequences, tokens) a step up to step ``until``, then ``then``: limits that drop below what runs."""

    name = "narrowing"

    def __init__(self, until: int, first: tuple[int, int], then: tuple[int, int]) -> None:
        super().__init__(TokenBudgetParams(max_num_seqs=first[0], max_num_batched_tokens=first[1]))
        self.until, self.first, self.then = until, first, then

    def limits(self, state):
        seqs, tokens = self.first if state.step <= self.until else self.then
        return type(super().limits(state))(max_num_seqs=seqs, max_num_tokens=tokens)


@pytest.mark.parametrize("order", ["decode-first", "prefill-first"])
def test_a_step_never_schedules_more_sequences_than_its_limit_even_below_the_running_count(order: str) -> None:
    run = FakeRun(FCFS(), Narrowing(2, (3, 64), (2, 64)), ChunkedPrefill(ChunkedPrefillParams(chunk_size=4)), order=order)
    for rid in "abc":
        run.add(rid, prompt_len=6, max_new=5)
    run.run()
    assert [len(s.out.scheduled) for s in run.steps][:2] == [3, 3]
    assert all(len(s.out.scheduled) <= 2 for s in run.steps[2:])
    assert all(s.num_output_tokens == 5 for s in run.seqs.values())


def test_more_decodes_than_the_token_budget_take_turns() -> None:
    run = FakeRun(FCFS(), budget(4, 2), ChunkedPrefill())
    for rid in "abc":
        run.add(rid, prompt_len=2, max_new=3)
    run.run()
    assert all(s.plan.num_tokens <= 2 for s in run.steps)
    assert all(s.num_output_tokens == 3 for s in run.seqs.values())



class TightWhileSwapped(TokenBudget):
    """While a request is swapped out: ``spare`` sequence slots and ``spare`` tokens beyond the running decodes."""

    name = "tight-while-swapped"

    def __init__(self, slots: int, tokens: int) -> None:
        super().__init__(TokenBudgetParams(max_num_seqs=4, max_num_batched_tokens=64))
        self.slots, self.tokens = slots, tokens

    def limits(self, state):
        limits = super().limits(state)
        if not state.swapped:
            return limits
        running = len(state.running)
        return type(limits)(max_num_seqs=max(1, running + self.slots), max_num_tokens=max(1, running + self.tokens))


SHORT_REQUESTS = (("a", 5, 8), ("b", 5, 8), ("c", 5, 8))  # in 5 blocks: one is swapped out
LONG_AND_SHORT = (("a", 9, 12), ("b", 2, 4), ("c", 2, 4))  # in 6 blocks: a short one is swapped out


def swap_run(budget_policy: TokenBudget, requests, num_blocks: int) -> FakeRun:
    """(request, prompt, max_new) requests in blocks of 4, swapping; every plan is checked as the engine does."""
    run = FakeRun(FCFS(), budget_policy, ChunkedPrefill(ChunkedPrefillParams(chunk_size=4)), Swap(),
                  num_blocks=num_blocks, host_blocks=16)  # fmt: skip
    for rid, prompt, max_new in requests:
        run.add(rid, prompt_len=prompt, max_new=max_new)
    run.run()
    assert any(s.out.swap_out for s in run.steps)
    assert [s.num_output_tokens for s in run.seqs.values()] == [max_new for _, _, max_new in requests]
    return run


def test_a_swapped_out_decode_stays_out_of_a_step_whose_tokens_the_running_decodes_used_up() -> None:
    run = swap_run(TightWhileSwapped(slots=2, tokens=0), LONG_AND_SHORT, num_blocks=6)
    assert all(s.plan.num_tokens <= s.out.limits.max_num_tokens for s in run.steps)


@pytest.mark.parametrize(("slots", "tokens"), [(1, 64), (4, 1)], ids=["last-slot", "last-token"])
def test_a_swapped_out_decode_takes_the_last_sequence_slot_or_token_of_a_step(slots: int, tokens: int) -> None:
    run = swap_run(TightWhileSwapped(slots=slots, tokens=tokens), SHORT_REQUESTS, num_blocks=5)
    assert any(len(s.out.scheduled) > 1 for s in run.steps if s.out.swap_in)


def test_a_waiting_request_is_admitted_with_the_last_token_of_the_budget() -> None:
    run = FakeRun(FCFS(), budget(4, 5), ChunkedPrefill(ChunkedPrefillParams(chunk_size=4)))
    run.add("a", prompt_len=4, max_new=2)
    run.add("b", prompt_len=4, max_new=2)
    assert run.step().chunks == [("a", 4, True), ("b", 1, False)]
    run = FakeRun(FCFS(), budget(4, 2), ChunkedPrefill(ChunkedPrefillParams(chunk_size=4)))
    run.add("a", prompt_len=2, max_new=3)
    run.step()
    run.add("b", prompt_len=4, max_new=2)  # after a's decode one token is left, at the admission phase's start
    assert run.step().chunks == [("a", 1, True), ("b", 1, False)]


def test_running_decodes_beyond_the_token_budget_take_turns_in_full_steps() -> None:
    run = FakeRun(FCFS(), Narrowing(1, (4, 3), (4, 2)), ChunkedPrefill())  # 3 tokens, then 2
    for rid in "abc":
        run.add(rid, prompt_len=1, max_new=3)
    run.run()
    assert [s.plan.num_tokens for s in run.steps] == [3, 2, 2, 1, 1]  # FCFS: a and b end first, then c alone


def test_a_waiting_request_alone_given_no_tokens_is_not_taken_for_one_too_big_for_the_cache() -> None:
    # It stops admission (no overtaking), so the step plans nothing: the policy's stall, not the request's error.
    run = FakeRun(FCFS(), budget(4, 64), Defers({"a"}))
    run.add("a", prompt_len=8, max_new=2)
    run.add("b", prompt_len=4, max_new=2)
    with pytest.raises(SchedulerStall, match="planned no tokens while work waits"):
        run.step()
    assert run.seqs["a"].status is SequenceStatus.WAITING and run.seqs["a"].error is None


def test_with_blocks_of_one_token_each_decode_takes_one_block() -> None:
    run = FakeRun(FCFS(), budget(4, 64), WholePrompt(), block_size=1)
    for rid in "ab":
        run.add(rid, prompt_len=3, max_new=4)
    for _ in range(3):
        run.step()
        assert all(len(s.block_table) == s.num_computed_tokens for s in run.seqs.values())


class FailingFinish(FCFS):
    """FCFS whose ``on_finish`` raises."""

    name = "failing-finish"

    def on_finish(self, seq, now):
        raise RuntimeError("on_finish failed")


def test_an_abort_whose_finish_event_raises_still_ends_the_request_and_returns_it() -> None:
    run = FakeRun(FailingFinish(), budget(4, 64), WholePrompt())
    seq = run.add("a", prompt_len=4)
    assert run.sched.abort("a") is seq and seq.finish_reason.value == "abort" and not run.sched.has_unfinished()
