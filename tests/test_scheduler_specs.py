"""The scheduler's counters and its admission loop at their edges, on the fake model (no model, milliseconds).

Counters are public (metrics read them): each event is counted once, and a
partial prefill taken back by a preemption in the same step is not counted.
A request the budget refuses is the budget's choice, not a lack of room:
the requests behind it are still admitted in that step.
"""

from __future__ import annotations

from cbcore.policies import FCFS, ChunkedPrefill, Priority, Swap, TokenBudget, WholePrompt
from cbcore.policies.chunked_prefill import ChunkedPrefillParams
from cbcore.policies.token_budget import TokenBudgetParams
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


def test_a_partial_prefill_taken_back_by_a_preemption_in_its_step_is_not_counted() -> None:
    # 5 blocks of 4. "low" runs 8-token chunks of a 24-token prompt; when "urgent" arrives, low's next
    # chunk is planned first (phase 1), then urgent, which does not fit, preempts it (phase 3).
    run = FakeRun(Priority(), budget(4, 64), ChunkedPrefill(ChunkedPrefillParams(chunk_size=8)), num_blocks=5)
    run.add("low", prompt_len=24, max_new=2, priority=5)
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
