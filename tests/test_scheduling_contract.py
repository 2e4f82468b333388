"""The scheduling contract: one test per rule of the scheduler's specification.

The specification is the module docstring of ``cbcore/scheduling/policy_scheduler.py``:
what each policy answer means, the five rules of a step in the order they
apply, and the events. Each test below is named after the rule it holds the
real :class:`PolicyScheduler` to, driven without a model by
:class:`cbcore.testing.FakeRun` (every plan goes through the engine's own plan
check; the fake model samples a token whenever a sequence's pending tokens are
done). The events' timing against the commit is checked on a real engine.
"""

from __future__ import annotations

import random
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

import pytest

from cbcore import Engine, EngineConfig, SamplingParams
from cbcore.policies import FCFS, ChunkedPrefill, Priority, Recompute, Swap, WholePrompt
from cbcore.policies.preemption import PreemptionParams, SwapParams
from cbcore.scheduling.policy import BudgetPolicy, PrefillPolicy, QueuePolicy, StepLimits
from cbcore.scheduling.sequence import FinishReason, SequenceStatus
from cbcore.testing import FakeRun, budget

# -- policies that answer as a test says -----------------------------------------------------


class Ranked(QueuePolicy):
    """Serves in the order of ``rank`` (smaller first), whatever the arrival order."""

    name = "ranked"

    def __init__(self, rank: dict[str, int]) -> None:
        super().__init__()
        self.rank = rank

    def key(self, seq: Any, now: float) -> tuple[int, str]:
        return (self.rank.get(seq.request_id, 0), seq.request_id)


class Refusing(BudgetPolicy):
    """A roomy budget whose ``may_admit`` refuses the requests in ``refused``."""

    name = "refusing"

    def __init__(self, refused: set[str]) -> None:
        super().__init__()
        self.refused = refused

    def limits(self, state: Any) -> StepLimits:
        return StepLimits(8, 64)

    def may_admit(self, seq: Any, state: Any) -> bool:
        return seq.request_id not in self.refused


class Answers(PrefillPolicy):
    """``num_tokens`` from a table (default: all that is pending, within the budget); records each question."""

    name = "answers"

    def __init__(self, answers: dict[str, int] | None = None) -> None:
        super().__init__()
        self.answers = answers or {}
        self.asked: list[tuple[str, int, int]] = []  # (request, its pending tokens, its computed tokens)

    def num_tokens(self, seq: Any, tokens_left: int, scheduled: Seq[Any]) -> int:
        self.asked.append((seq.request_id, seq.num_pending_tokens, seq.num_computed_tokens))
        return self.answers.get(seq.request_id, min(seq.num_pending_tokens, tokens_left))


class WatchedRecompute(Recompute):
    """Recompute, the newest first, remembering every candidate list it was shown."""

    def __init__(self, params: PreemptionParams | None = None) -> None:
        super().__init__(params)
        self.shown: list[list[str]] = []

    def choose_victim(self, candidates: Seq[Any], queue: QueuePolicy, now: float) -> Any:
        self.shown.append(sorted(c.request_id for c in candidates))
        return super().choose_victim(candidates, queue, now)


def ids(seqs: Any) -> list[str]:
    return [s.request_id for s in seqs]


def scheduled(step: Any) -> list[str]:
    return [item.seq.request_id for item in step.out.scheduled]


# -- what the answers mean ---------------------------------------------------------------------


def test_key_is_the_order_waiting_sequences_are_served_in() -> None:
    run = FakeRun(Ranked({"a": 3, "b": 1, "c": 2}), budget(max_seqs=1), WholePrompt())
    for rid in "abc":
        run.add(rid, 4, 1)
    run.run()
    assert [rid for step in run.steps for rid in step.first_time] == ["b", "c", "a"]


def test_the_last_in_queue_order_is_evicted_first_among_the_running() -> None:
    victim_by_order = Recompute(PreemptionParams(victim="queue-order"))
    run = FakeRun(Ranked({"c": 1, "b": 2, "a": 3}), budget(), WholePrompt(), victim_by_order, num_blocks=4)
    for rid in "abc":
        run.add(rid, 4, 8)  # one block each; the next token of each needs a second block
    run.step()
    step = run.step()
    assert ids(step.out.preempted) == ["a"] and scheduled(step) == ["c", "b"]


def test_limits_cap_the_sequences_and_tokens_of_every_step_and_the_running_set() -> None:
    run = FakeRun(FCFS(), budget(max_seqs=2, max_tokens=10), ChunkedPrefill())
    for i in range(5):
        run.add(f"r{i}", 7, 3)
    running: list[int] = []
    run.run(each=lambda r: running.append(len(r.sched.running)))
    assert max(len(s.out.scheduled) for s in run.steps) == 2
    assert max(s.plan.num_tokens for s in run.steps) == 10
    assert max(running) == 2


def test_may_admit_false_passes_a_sequence_over_without_stopping_those_behind() -> None:
    refusing = Refusing({"b"})
    run = FakeRun(FCFS(), refusing, WholePrompt())
    for rid in "abc":
        run.add(rid, 4, 4)
    assert run.step().first_time == ["a", "c"]
    refusing.refused.clear()
    assert run.step().first_time == ["b"]


def test_num_tokens_zero_skips_a_running_sequence_this_step() -> None:
    answers = Answers()
    run = FakeRun(FCFS(), budget(), answers)
    run.add("a", 8, 2)
    run.add("b", 8, 2)
    answers.answers["a"] = 4  # a's prompt in two chunks
    run.step()
    answers.answers["a"] = 0
    step = run.step()
    assert scheduled(step) == ["b"] and run.seqs["a"].num_computed_tokens == 4


def test_num_tokens_zero_for_a_waiting_sequence_stops_admission_behind_it() -> None:
    run = FakeRun(FCFS(), budget(), Answers({"a": 0}))
    run.add("r", 4, 4)
    run.step()
    run.add("a", 8, 2)
    run.add("b", 8, 2)
    assert scheduled(run.step()) == ["r"]  # b does not overtake a
    assert ids(run.sched.waiting) == ["a", "b"]


def test_num_tokens_above_what_is_pending_runs_all_of_it() -> None:
    run = FakeRun(FCFS(), budget(), Answers({"a": 50}))
    run.add("a", 10, 2)
    assert run.step().chunks == [("a", 10, True)]


def test_a_decode_runs_its_one_token_without_asking_num_tokens() -> None:
    answers = Answers()
    run = FakeRun(FCFS(), budget(), answers)
    run.add("a", 6, 4)
    run.run()
    assert [a[0] for a in answers.asked] == ["a"]  # the prompt only, never its three decodes
    assert [c for s in run.steps for c in s.chunks] == [("a", 6, True), ("a", 1, True), ("a", 1, True), ("a", 1, True)]


def test_recompute_frees_the_victim_which_waits_at_its_queue_position() -> None:
    run = FakeRun(FCFS(), budget(), WholePrompt(), Recompute(), num_blocks=4)
    for rid in "abc":
        run.add(rid, 4, 8)
    run.step()
    run.now = 0.5
    step = run.step()
    victim = run.seqs["c"]
    assert ids(step.out.preempted) == ["c"]
    assert (victim.status, victim.num_computed_tokens, victim.block_table) == (SequenceStatus.WAITING, 0, [])
    run.add("later", 4, 1)  # arrives after c did: c is served first
    run.run()
    order = [rid for s in run.steps[2:] for rid, _, _ in s.chunks if rid in ("c", "later")]
    assert order.index("c") < order.index("later")


@pytest.mark.parametrize("host_blocks", [8, 0], ids=["host-room", "host-full"])
def test_swap_moves_the_victim_to_host_memory_or_recomputes_it_when_the_host_pool_is_full(host_blocks: int) -> None:
    run = FakeRun(FCFS(), budget(), WholePrompt(), Swap(), num_blocks=4, host_blocks=host_blocks)
    for rid in "abc":
        run.add(rid, 4, 8)
    run.step()
    step = run.step()
    victim = run.seqs["c"]
    assert ids(step.out.preempted) == ["c"]
    if host_blocks:
        assert victim.status is SequenceStatus.SWAPPED and victim.num_computed_tokens == 4
        assert len(step.out.swap_out) == 1 and run.blocks.host_blocks_of(victim)
    else:
        assert victim.status is SequenceStatus.WAITING and victim.num_computed_tokens == 0
        assert step.out.swap_out == [] and run.sched.num_swap_fallbacks == 1
    run.run()
    assert victim.num_output_tokens == 8


# -- rule 1: the running sequences -------------------------------------------------------------


@pytest.mark.parametrize("order", ["decode-first", "prefill-first"])
def test_running_sequences_are_served_in_queue_order_decodes_before_chunks(order: str) -> None:
    run = FakeRun(Ranked({"p": 0, "d2": 1, "d1": 2}), budget(), Answers({"p": 4}), order=order)
    run.add("p", 40, 2)  # first in the queue, prefilled in chunks of 4
    run.add("d1", 3, 8)
    run.add("d2", 3, 8)
    run.step()
    expected = ["d2", "d1", "p"] if order == "decode-first" else ["p", "d2", "d1"]
    assert scheduled(run.step()) == expected


def test_a_sequence_that_cannot_grow_evicts_among_the_running_not_yet_scheduled() -> None:
    watched = WatchedRecompute()
    run = FakeRun(FCFS(), budget(), WholePrompt(), watched, num_blocks=4)
    for rid in "abc":
        run.add(rid, 4, 8)
    run.step()  # three blocks of four; the next token of each needs a new block, one is free
    step = run.step()
    assert watched.shown == [["b", "c"]]  # a took the free block first: no longer a candidate
    assert ids(step.out.preempted) == ["c"] and scheduled(step) == ["a", "b"]


def test_with_no_other_candidate_the_sequence_itself_is_evicted() -> None:
    run = FakeRun(FCFS(), budget(), WholePrompt(), Recompute(), num_blocks=3)
    run.add("a", 4, 8)
    run.add("b", 4, 8)
    run.step()
    step = run.step()  # a takes the one free block; b can only evict itself
    assert ids(step.out.preempted) == ["b"] and scheduled(step) == ["a"]


def test_a_sequence_alone_in_the_cache_that_cannot_grow_ends_with_an_error() -> None:
    run = FakeRun(FCFS(), budget(), WholePrompt(), num_blocks=2)
    seq = run.add("a", 4, 20)  # 8 tokens fit in the cache, 24 never will
    run.run()
    assert seq.finish_reason is FinishReason.ERROR and "needs 3 KV blocks for 9 tokens" in (seq.error or "")
    assert seq.num_output_tokens == 5 and any(ids(s.out.failed) == ["a"] for s in run.steps)


def test_when_every_decode_fits_all_are_scheduled_at_once_in_queue_order() -> None:
    watched = WatchedRecompute()
    run = FakeRun(Ranked({"c": 1, "a": 2, "b": 3}), budget(), WholePrompt(), watched)
    for rid in "abc":
        run.add(rid, 3, 4)
    run.step()
    for _ in range(3):
        assert scheduled(run.step()) == ["c", "a", "b"]
    assert watched.shown == []


@pytest.mark.parametrize("preemption", [Recompute(PreemptionParams(victim="lowest-priority")),
                                        Swap(SwapParams(victim="lowest-priority"))], ids=["recompute", "swap"])  # fmt: skip
def test_prefill_first_a_decode_evicted_for_a_chunk_is_not_scheduled_with_the_other_decodes(preemption: Any) -> None:
    """Under prefill-first the chunks grow before the decodes; a decode one of them evicted (and whose
    blocks leave room) must not come back in the decodes' one-pass path of the same step."""
    run = FakeRun(FCFS(), budget(), Answers({"a": 4}), preemption, num_blocks=4, host_blocks=8, order="prefill-first")
    run.add("a", 40, 2)  # a chunk of 4 a step: one new block each step
    run.add("b", 3, 8)  # decodes within its one block
    run.add("c", 7, 8, priority=1)  # two blocks, the lowest priority: the victim
    run.step()
    assert run.blocks.num_free_blocks == 0
    step = run.step()  # plan-checked: a scheduled victim would be refused as not running
    assert ids(step.out.preempted) == ["c"]
    assert scheduled(step) == ["a", "b"] and run.blocks.num_free_blocks == 1


# -- rule 2: the swapped sequences -------------------------------------------------------------


def _fcfs_rank(seq: Any) -> tuple[float, str]:
    return (seq.arrival_time, seq.request_id)


def _swapping_run(seed: int, n: int = 12) -> tuple[FakeRun, list[dict[str, Any]]]:
    """A run under memory pressure with swap preemption and a request arriving every step; before each
    step, who was swapped out (in queue order) and who waited."""
    rng = random.Random(seed)
    run = FakeRun(FCFS(), budget(6, 16), ChunkedPrefill(), Swap(), num_blocks=6, host_blocks=64)
    before: list[dict[str, Any]] = []
    for i in range(n):
        run.add(f"r{i:02}", rng.randint(1, 10), rng.randint(2, 20))
        if run.sched.has_unfinished():
            before.append({"swapped": ids(sorted(run.sched.swapped, key=_fcfs_rank)),
                           "waiting": set(ids(run.sched.waiting))})  # fmt: skip
            run.step()
        run.now += 0.5
    while run.sched.has_unfinished():
        before.append({"swapped": ids(sorted(run.sched.swapped, key=_fcfs_rank)), "waiting": set(ids(run.sched.waiting))})
        run.step()
    return run, before


def test_swapped_sequences_return_in_queue_order_and_the_first_that_does_not_fit_stops_them() -> None:
    run, before = _swapping_run(seed=13)
    partial = 0
    for k, (step, was) in enumerate(zip(run.steps, before, strict=True)):
        back = [rid for rid in scheduled(step) if rid in was["swapped"]]
        candidates = [rid for rid in was["swapped"] if rid not in ids(step.out.preempted)]
        assert back == candidates[: len(back)], f"step {k + 1}: {back} came back out of order of {candidates}"
        partial += 0 < len(back) < len(candidates)
    assert partial, "no step brought back some swapped sequences but not all: the run proves little"


def test_nothing_new_is_admitted_while_a_sequence_is_swapped_out() -> None:
    run, before = _swapping_run(seed=13)
    blocked = 0
    for k, (step, was) in enumerate(zip(run.steps, before, strict=True)):
        new = [rid for rid in scheduled(step) if rid in was["waiting"]]
        if was["swapped"]:
            assert not new, f"step {k + 1} admitted {new} while {was['swapped']} were swapped out"
            blocked += bool(was["waiting"])
    assert blocked, "no request ever waited while another was swapped out"


def test_a_sequence_swapped_out_in_a_step_does_not_come_back_in_the_same_step() -> None:
    answers = Answers({"e": 4, "b": 12})
    swap = Swap(SwapParams(victim="lowest-priority"))
    run = FakeRun(FCFS(), budget(), answers, swap, num_blocks=6, host_blocks=16, order="prefill-first")
    for rid, prompt_len, priority in [("e", 40, 0), ("c", 4, 1), ("b", 24, 0)]:
        run.add(rid, prompt_len, 8, priority=priority)  # e in chunks of 4, b of 12; c decodes
        run.now += 1
    run.step()  # e 1 block, c 1, b 3: one free
    step = run.step()  # e takes it; b evicts c (the lowest priority), still does not fit, and evicts itself
    assert ids(step.out.preempted) == ["c", "b"] and scheduled(step) == ["e"]
    assert step.out.swap_in == [] and run.blocks.can_swap_in(run.seqs["c"], 1)  # c is first and fits, yet stays out


# -- rule 3: the waiting sequences -------------------------------------------------------------


def test_no_admission_in_a_step_that_preempted() -> None:
    run = FakeRun(FCFS(), budget(), Answers({"b": 8}), Recompute(), num_blocks=5)
    run.add("a", 4, 8)
    run.add("b", 24, 2)  # 8 tokens a step: two new blocks each step
    run.step()  # a 1 block, b 2: two free
    run.add("late", 3, 2)  # one block would do
    step = run.step()  # a takes a block for its next token; b, short of one, evicts itself
    assert ids(step.out.preempted) == ["b"] and run.blocks.num_free_blocks == 3
    assert "late" not in step.first_time
    assert "late" in run.step().first_time


def test_a_cached_prefix_is_mapped_before_num_tokens_is_asked() -> None:
    answers = Answers()
    run = FakeRun(FCFS(), budget(), answers, prefix_caching=True)
    run.add("first", 12, 1)
    run.run()
    run.add("second", 12, 1)  # the same twelve tokens: two full blocks are cached
    step = run.step()
    assert answers.asked[-1] == ("second", 4, 8)  # asked about the rest only
    assert step.chunks == [("second", 4, True)]


def test_no_overtaking_the_first_waiting_sequence_that_does_not_fit_stops_admission() -> None:
    run = FakeRun(FCFS(), budget(), WholePrompt(), num_blocks=6)
    run.add("running", 12, 30)  # three blocks
    run.step()
    run.add("big", 16, 1)  # four blocks: does not fit in the three free
    run.add("small", 4, 1)  # would fit
    step = run.step()
    assert step.first_time == [] and ids(run.sched.waiting) == ["big", "small"]


@pytest.mark.parametrize("room", [True, False], ids=["eviction-makes-room", "eviction-cannot"])
def test_a_waiting_sequence_evicts_what_it_outranks_only_when_that_makes_room(room: bool) -> None:
    run = FakeRun(Priority(), budget(), WholePrompt(), num_blocks=8 if room else 12)
    if room:
        run.add("low", 24, 8, priority=3)  # six blocks of eight
    else:
        run.add("high", 20, 30, priority=0)  # five blocks, more as it decodes
        run.add("low", 4, 30, priority=5)  # one or two
    run.step()
    run.add("urgent", 16 if room else 36, 2, priority=1)  # four blocks; nine
    step = run.step()
    if room:  # evicting low frees six blocks: urgent is admitted in its place
        assert ids(step.out.preempted) == ["low"] and "urgent" in step.first_time
    else:  # urgent outranks only low, and evicting it could never free nine blocks: low keeps running
        assert step.out.preempted == [] and "urgent" not in step.first_time
        assert run.seqs["low"].status is SequenceStatus.RUNNING


def test_a_waiting_sequence_too_big_for_the_whole_cache_fails_and_admission_goes_on() -> None:
    run = FakeRun(FCFS(), budget(), WholePrompt(), num_blocks=8)
    big = run.add("big", 40, 1)  # ten blocks of four; the cache has eight
    run.add("small", 4, 1)
    step = run.step()
    assert ids(step.out.failed) == ["big"] and big.finish_reason is FinishReason.ERROR
    assert step.first_time == ["small"]


# -- rules 4 and 5 -----------------------------------------------------------------------------


def test_swap_outs_are_planned_before_swap_ins_so_a_swap_in_may_reuse_a_freed_block() -> None:
    """The fake model copies out before it copies in, as the runner does, and checks every cached key
    of every scheduled sequence each step: a swap-in into a block a swap-out of the same step freed
    keeps both sequences' KV."""
    run = FakeRun(FCFS(), budget(4, 16), ChunkedPrefill(), Swap(), num_blocks=5, host_blocks=16, kv=True)
    for i, (prompt_len, max_new) in enumerate([(8, 8), (5, 7), (4, 8)]):
        run.add(f"r{i}", prompt_len, max_new)
    run.run()
    reused = [
        s for s in run.steps if {d for d, _ in s.out.swap_out} & {d for _, d in s.out.swap_in}
    ]
    assert reused, "no step swapped a sequence into a block another was swapped out of"
    assert all(s.num_output_tokens == s.params.max_new_tokens for s in run.seqs.values())


def test_the_first_admission_time_is_stamped_once() -> None:
    run = FakeRun(FCFS(), budget(), WholePrompt(), Recompute(), num_blocks=4)
    for rid in "abc":
        run.add(rid, 4, 8)
    run.step()
    first = run.seqs["c"].first_scheduled_time
    run.step()  # c is preempted (recompute) and admitted again later
    run.run()
    assert run.seqs["c"].num_preemptions >= 1 and run.seqs["c"].first_scheduled_time == first == 0.0


# -- the events --------------------------------------------------------------------------------


class Heard(FCFS):
    """FCFS that records every event it hears."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple] = []

    def on_arrival(self, seq: Any, now: float) -> None:
        self.log.append(("arrival", seq.request_id))

    def on_step_end(self, results: Seq[Any], now: float) -> None:
        self.log.append(("step", tuple((r.seq.request_id, r.num_computed, r.new_token, r.preempted) for r in results)))

    def on_finish(self, seq: Any, now: float) -> None:
        self.log.append(("finish", seq.request_id))


def test_on_step_end_hears_what_each_sequence_computed_and_sampled_and_who_was_preempted() -> None:
    heard = Heard()
    run = FakeRun(heard, budget(), WholePrompt(), Recompute(), num_blocks=4)
    for rid in "abc":
        run.add(rid, 4, 8)
    run.step()
    run.step()
    steps = [entry[1] for entry in heard.log if entry[0] == "step"]
    assert steps[0] == (("a", 4, 7, False), ("b", 4, 7, False), ("c", 4, 7, False))
    assert steps[1] == (("a", 1, 7, False), ("b", 1, 7, False), ("c", 0, None, True))


def test_on_finish_follows_the_step_end_of_the_step_that_ended_the_request() -> None:
    heard = Heard()
    run = FakeRun(heard, budget(), WholePrompt())
    run.add("short", 4, 1)
    run.add("long", 4, 3)
    run.run()
    events = [e[0] if e[0] == "step" else e for e in heard.log]
    assert events == [("arrival", "short"), ("arrival", "long"), "step", ("finish", "short"), "step", "step",
                      ("finish", "long")]  # fmt: skip


def test_on_arrival_comes_from_add_and_an_aborts_on_finish_from_abort() -> None:
    heard = Heard()
    run = FakeRun(heard, budget(), WholePrompt())
    run.add("a", 4, 8)
    assert heard.log == [("arrival", "a")]
    run.step()
    run.sched.abort("a")
    assert heard.log[-1] == ("finish", "a") and not run.sched.has_unfinished()


RECORDING_PLUGIN = '''
from cbcore import PrefillPolicy, QueuePolicy, hookimpl


class Recording(QueuePolicy):
    """FCFS; on each step's end, what the committed sequences hold."""

    name = "recording"

    def __init__(self, params=None):
        super().__init__(params)
        self.log = []

    def key(self, seq, now):
        return (seq.arrival_time, seq.request_id)

    def on_step_end(self, results, now):
        self.log.append([(r.seq.request_id, r.new_token, r.seq.output_token_ids[-1:], r.seq.num_computed_tokens,
                          r.seq.num_tokens) for r in results])

    def on_finish(self, seq, now):
        self.log.append(("finish", seq.request_id, seq.finish_reason))


class FailsOnce(PrefillPolicy):
    """All of a prompt at once, but raises the first time it is asked about request 'bad'."""

    name = "fails-once"

    def __init__(self, params=None):
        super().__init__(params)
        self.failed = False

    def num_tokens(self, seq, tokens_left, scheduled):
        if seq.request_id == "bad" and not self.failed:
            self.failed = True
            raise RuntimeError("no")
        return seq.num_pending_tokens


@hookimpl
def cbcore_register_policies():
    return [Recording, FailsOnce]
'''


def test_events_arrive_after_the_step_commits_and_a_step_planned_again_is_heard_once(
    tmp_path: Path, models: dict
) -> None:
    plugin = tmp_path / "recording.py"
    plugin.write_text(RECORDING_PLUGIN)
    config = EngineConfig.model_validate({
        "plugins": [str(plugin)],
        "scheduler": {"queue": {"name": "recording"}, "prefill": {"name": "fails-once"}},
        "kv_cache": {"block_size": 4, "num_blocks": 64},
        "backend": {"name": "eager"},
    })  # fmt: skip
    engine = Engine(models["llama"], None, config)
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    for rid in ("good", "bad"):
        engine.add_request([5, 6, 7, 8, 9], params, request_id=rid)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    log = engine.scheduler.door.queue.log
    step_ends = [entry for entry in log if not isinstance(entry, tuple)]
    assert len(step_ends) == steps  # the failed plan of step 1 was undone and is never heard
    for results in step_ends:
        for rid, new_token, last, computed, total in results:
            assert rid == "good" and last == (new_token,)  # the token is already appended: committed
            assert computed == total - 1  # and the KV of everything before it is computed
    assert ("finish", "bad", "error") in log and ("finish", "good", "length") in log
