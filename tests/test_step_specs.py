"""The step's rules at their edges: the progress guarantee's count, decode rows, swap pairs, preempted results.

``test_plan_rules`` breaks each rule of the plan check once; these pin where
each rule's edge lies: how many steps without progress the engine allows and
what its error says, that the first generated token fed back is a decode row
while a prompt's last token is not, that a negative block number is no block,
and that a preempted request is reported to the policies with nothing computed.
"""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
import torch
from support import PROMPTS

from cbcore import Engine, EngineConfig, SamplingParams
from cbcore.plugins import load_class
from cbcore.policies import FCFS, ChunkedPrefill, Swap, WholePrompt
from cbcore.policies.chunked_prefill import ChunkedPrefillParams
from cbcore.scheduling.block_manager import BlockManager
from cbcore.scheduling.plan import Sampled
from cbcore.scheduling.policy import StepLimits
from cbcore.scheduling.sampling_params import SamplingParams as Params
from cbcore.scheduling.scheduler import ScheduledSeq, SchedulerError, SchedulerOutput, SchedulerStall
from cbcore.scheduling.sequence import FinishReason, Sequence, SequenceStatus
from cbcore.scheduling.step import MAX_IDLE_STEPS, Steps, StepTransaction, check_plan
from cbcore.testing.fake_run import FakeRun, budget

CULPRIT = "scheduler 'probe' (test)"


def steps() -> Steps:
    blocks = SimpleNamespace(capacity_tokens=64)
    return Steps(scheduler=SimpleNamespace(blocks=blocks), culprit=CULPRIT, clock=lambda: 0.0)  # type: ignore[arg-type]


def moved() -> SchedulerOutput:
    """A step that computes nothing but preempts: progress of a kind, for a bounded number of steps."""
    return SchedulerOutput(preempted=[Sequence("victim", [1], Params())])


def test_a_step_that_computes_and_moves_nothing_while_work_waits_is_a_stall_at_once() -> None:
    with pytest.raises(SchedulerStall, match="and changed nothing: it would spin forever"):
        steps().observe(SchedulerOutput(), computed=0, sampled=0, waiting=1, holding=0)
    steps().observe(SchedulerOutput(), computed=0, sampled=0, waiting=0, holding=0)  # nothing waits: no stall


def test_steps_that_only_move_kv_are_allowed_max_idle_steps_times_in_a_row_counted_from_the_last_progress() -> None:
    s = steps()
    for _ in range(3):
        s.observe(moved(), computed=0, sampled=0)
    s.observe(SchedulerOutput(), computed=4, sampled=1)  # progress: the count starts again
    for _ in range(MAX_IDLE_STEPS):
        s.observe(moved(), computed=0, sampled=0)
    with pytest.raises(SchedulerStall, match=f"computed nothing for {MAX_IDLE_STEPS + 1} steps"):
        s.observe(moved(), computed=0, sampled=0)


def running(blocks: BlockManager, rid: str, prompt: int, computed: int, output: int = 0) -> Sequence:
    seq = Sequence(rid, list(range(1, prompt + 1)), Params())
    seq.token_ids.extend([7] * output)
    seq.status = SequenceStatus.RUNNING
    seq.num_computed_tokens = computed
    blocks.grow(seq, seq.num_tokens - computed)
    return seq


def finishing(params: Params, output: int = 0, max_model_len: int | None = None) -> tuple[Steps, Sequence]:
    s = steps()
    s.eos_token_ids, s.max_model_len = frozenset({2}), max_model_len
    seq = Sequence("r", [1, 1, 1], params)
    seq.status = SequenceStatus.RUNNING
    seq.token_ids.extend([5] * output)
    return s, seq


@pytest.mark.parametrize(
    ("params", "token", "reason"),
    [
        (Params(max_new_tokens=9), 2, "stop"),  # EOS
        (Params(max_new_tokens=9, ignore_eos=True), 2, None),
        (Params(max_new_tokens=9, stop_token_ids=[4]), 4, "stop"),  # a stop token that is not EOS
        (Params(max_new_tokens=9, ignore_eos=True, stop_token_ids=[2]), 2, "stop"),  # ignore_eos spares EOS only
        (Params(max_new_tokens=9, stop_token_ids=[4]), 5, None),
    ],
)
def test_a_request_stops_on_eos_unless_it_ignores_eos_and_on_each_of_its_stop_tokens(params, token, reason) -> None:
    s, seq = finishing(params)
    seq.append_token(token, 1.0)
    s.finish_rule(seq, token, 1.0)
    assert (seq.finish_reason.value if seq.finish_reason else None) == reason


@pytest.mark.parametrize(
    ("params", "max_model_len"),
    [(Params(max_new_tokens=3), None), (Params(max_new_tokens=50), 6)],  # 3 prompt tokens + 1 generated
    ids=["max_new_tokens", "context"],
)
def test_a_request_ends_by_length_at_its_max_new_tokens_or_at_the_models_context_not_before(
    params: Params, max_model_len: int | None
) -> None:
    s, seq = finishing(params, output=1, max_model_len=max_model_len)
    seq.append_token(5, 1.0)
    s.finish_rule(seq, 5, 1.0)
    assert not seq.is_finished  # one short of the limit
    seq.append_token(5, 2.0)
    s.finish_rule(seq, 5, 2.0)
    assert seq.finish_reason.value == "length"


def test_the_first_generated_token_fed_back_is_a_decode_row_and_a_prompts_last_token_is_not() -> None:
    blocks = BlockManager(num_blocks=8, block_size=4, num_host_blocks=0)
    first_decode = running(blocks, "first-decode", prompt=6, computed=6, output=1)
    later_decode = running(blocks, "later-decode", prompt=3, computed=5, output=3)
    last_prompt_token = running(blocks, "last-prompt-token", prompt=5, computed=4)
    out = SchedulerOutput(scheduled=[ScheduledSeq(s, 1) for s in (first_decode, later_decode, last_prompt_token)])
    plan, total, sampled = check_plan(out, blocks, CULPRIT)
    assert [row.decode for row in plan.rows] == [True, True, False]
    assert (plan.num_decode_tokens, total, sampled) == (2, 3, 3)


@pytest.mark.parametrize(
    ("side", "pair"),
    [("swap_out", (-1, 0)), ("swap_out", (0, -1)), ("swap_in", (-1, 0)), ("swap_in", (0, -1))],
)
def test_a_negative_block_number_in_a_swap_pair_names_no_block(side: str, pair: tuple[int, int]) -> None:
    blocks = BlockManager(num_blocks=8, block_size=4, num_host_blocks=4)
    seq = running(blocks, "r", prompt=6, computed=6, output=1)
    out = SchedulerOutput(scheduled=[ScheduledSeq(seq, 1)], **{side: [pair]})
    with pytest.raises(SchedulerError, match="swap pairs name existing blocks") as caught:
        check_plan(out, blocks, CULPRIT)
    assert caught.value.plugin == CULPRIT


class RecordingQueue(FCFS):
    """FCFS that keeps every result its ``on_step_end`` is handed."""

    name = "recording-queue"
    handed: ClassVar[list] = []

    def on_step_end(self, results, now):
        type(self).handed.extend(results)


def test_a_preempted_request_is_reported_to_the_policies_with_nothing_computed_and_no_token(models) -> None:
    recording = load_class(f"{__file__}:RecordingQueue")  # the class the engine loads (its own module)
    recording.handed = handed = []
    scheduler = {
        "queue": {"name": f"{__file__}:RecordingQueue"},
        "budget": {"name": "token-budget", "max_num_seqs": 4, "max_num_batched_tokens": 64},
        "preemption": {"name": "recompute"},
    }
    kv = {"block_size": 4, "num_blocks": 10}
    config = EngineConfig.model_validate({"backend": {"name": "eager"}, "kv_cache": kv, "scheduler": scheduler})
    engine = Engine(models["llama"], config=config)
    for i in range(3):
        engine.add_request(list(PROMPTS[i][:10]), SamplingParams(max_new_tokens=12, ignore_eos=True), request_id=f"r{i}")
    for _ in range(200):
        if not engine.has_unfinished():
            break
        engine.step()
    preempted = [r for r in handed if r.preempted]
    assert preempted, "the cache was meant to be too small for every request at once"
    assert all(r.num_computed == 0 and r.new_token is None for r in preempted)
    assert all(r.num_computed > 0 for r in handed if not r.preempted)


def test_a_fresh_engine_allows_max_idle_steps_steps_that_only_move_kv_and_names_the_next_one() -> None:
    s = steps()
    for _ in range(MAX_IDLE_STEPS):
        s.observe(moved(), computed=0, sampled=0)
    with pytest.raises(SchedulerStall, match=f"computed nothing for {MAX_IDLE_STEPS + 1} steps"):
        s.observe(moved(), computed=0, sampled=0)


def test_a_stall_reported_without_counts_says_one_request_waits_and_none_holds_kv() -> None:
    with pytest.raises(SchedulerStall, match=r"\(1 waiting, 0 holding KV\) and changed nothing"):
        steps().observe(SchedulerOutput(), computed=0, sampled=0)


@pytest.mark.parametrize("side", ["swap_out", "swap_in"])
def test_a_step_that_only_swaps_kv_one_way_is_movement_not_a_stall(side: str) -> None:
    s = steps()
    s.observe(SchedulerOutput(**{side: [(0, 0)]}), computed=0, sampled=0, waiting=1)
    assert s.idle == 1


def test_the_livelock_bound_counts_tokens_from_the_last_sampled_one_up_to_the_window() -> None:
    s = steps()
    s.observe(SchedulerOutput(), computed=5, sampled=1)
    s.observe(SchedulerOutput(), computed=s.window, sampled=0)  # exactly the window: allowed
    with pytest.raises(SchedulerStall, match=f"computed {s.window + 1} tokens without sampling one"):
        s.observe(SchedulerOutput(), computed=1, sampled=0)


def test_one_prompt_alone_may_exceed_the_token_budget_but_not_with_another() -> None:
    blocks = BlockManager(num_blocks=8, block_size=4, num_host_blocks=0)
    long = running(blocks, "long", prompt=10, computed=0)
    short = running(blocks, "short", prompt=2, computed=0)
    limits = StepLimits(max_num_seqs=4, max_num_tokens=8)
    plan, total, _ = check_plan(SchedulerOutput([ScheduledSeq(long, 10)], limits=limits), blocks, CULPRIT)
    assert total == 10 and len(plan.rows) == 1
    with pytest.raises(SchedulerError, match="the step's tokens fit its budget"):
        check_plan(
            SchedulerOutput([ScheduledSeq(long, 10), ScheduledSeq(short, 2)], limits=limits), blocks, CULPRIT
        )


@pytest.mark.parametrize(
    ("side", "pair"),
    [("swap_out", (8, 0)), ("swap_out", (0, 4)), ("swap_in", (4, 0)), ("swap_in", (0, 8))],
)
def test_a_block_number_one_past_the_last_in_a_swap_pair_names_no_block(
    side: str, pair: tuple[int, int]
) -> None:
    blocks = BlockManager(num_blocks=8, block_size=4, num_host_blocks=4)
    seq = running(blocks, "r", prompt=6, computed=6, output=1)
    with pytest.raises(SchedulerError, match="swap pairs name existing blocks"):
        check_plan(SchedulerOutput(scheduled=[ScheduledSeq(seq, 1)], **{side: [pair]}), blocks, CULPRIT)
    last = (7, 3) if side == "swap_out" else (3, 7)  # the last blocks are blocks
    check_plan(SchedulerOutput(scheduled=[ScheduledSeq(seq, 1)], **{side: [last]}), blocks, CULPRIT)


def test_a_refused_row_is_diagnosed_by_the_rule_it_breaks_with_its_numbers() -> None:
    blocks = BlockManager(num_blocks=8, block_size=4, num_host_blocks=0)
    waiting = Sequence("w", [1, 2], Params())
    ended = running(blocks, "e", prompt=3, computed=3, output=1)
    ended.finish(FinishReason.STOP, 1.0)
    short = running(blocks, "s", prompt=8, computed=0)
    short.token_ids.append(7)  # 9 tokens, 2 blocks: one token has no slot
    cases = [(waiting, 1, "'w' is waiting;"), (ended, 1, "'e' is finished (stop)"),
             (short, 9, "'s' computes up to token 9 but its 2 blocks hold 8")]  # fmt: skip
    short_one = running(blocks, "one", prompt=8, computed=8, output=1)
    short_one.block_table.pop()  # its one pending token has no slot
    cases.append((short_one, 1, "a KV slot is allocated for every token"))
    for seq, n, match in cases:
        with pytest.raises(SchedulerError, match=re.escape(match)):
            check_plan(SchedulerOutput([ScheduledSeq(seq, n)]), blocks, CULPRIT)


# -- the transaction: what a commit appends and an undo takes back -----------------------------


def transaction(run: FakeRun) -> tuple[StepTransaction, Any]:
    """The next step of ``run`` planned and checked as the engine does, not yet executed."""
    tx = StepTransaction(run.rules, [s for s in run.seqs.values() if not s.is_finished])
    return tx, tx.check(run.sched.schedule())


def three_prompts() -> FakeRun:
    run = FakeRun(FCFS(), budget(4, 64), WholePrompt())
    for rid in "abc":
        run.add(rid, prompt_len=4, max_new=4)
    return run


def test_a_commit_ends_only_the_rows_whose_sampling_failed_and_keeps_the_logprobs_given() -> None:
    run = three_prompts()
    tx, _ = transaction(run)
    a, b, c = (run.seqs[r] for r in "abc")
    new, failed, _ = tx.commit(
        Sampled([0, 1, 2], [7, 8, 9], [None, {8: -0.5}, None], ["sampler failed", None, None])
    )
    assert failed == [a] and (a.finish_reason, a.error, a.num_output_tokens) == (
        FinishReason.ERROR,
        "sampler failed",
        0,
    )
    assert new == {b: 8, c: 9} and b.logprobs == [{8: -0.5}] and c.logprobs == []


def test_a_commit_without_errors_appends_every_rows_token() -> None:
    run = three_prompts()
    tx, _ = transaction(run)
    new, failed, _ = tx.commit(Sampled([0, 1, 2], [7, 8, 9], [None, None, None]))
    assert failed == [] and [s.token_ids[-1] for s in run.seqs.values()] == [7, 8, 9] and len(new) == 3


def test_a_sampler_answer_without_a_token_for_every_sampling_row_is_refused() -> None:
    run = three_prompts()
    tx, _ = transaction(run)
    with pytest.raises(ValueError):
        tx.commit(Sampled([0, 1, 2], [7, 8], [None, None]))


def test_an_undone_step_takes_back_each_token_and_its_logprobs_and_nothing_more() -> None:
    run = three_prompts()
    a, b, c = (run.seqs[r] for r in "abc")
    tx, _ = transaction(run)
    tx.commit(Sampled([0, 1, 2], [7, 8, 9], [{7: -0.1}, None, {9: -0.2}]))
    run.sched.on_step_end(tx.out, [])
    tx, _ = transaction(run)  # the second step: a and c ask for logprobs again, b never does
    tx.commit(Sampled([0, 1, 2], [7, 8, 9], [{7: -0.3}, None, None]))
    tx.undo()
    assert [s.num_output_tokens for s in (a, b, c)] == [1, 1, 1]
    assert (a.logprobs, b.logprobs, c.logprobs) == ([{7: -0.1}], [], [{9: -0.2}])
    tx, _ = transaction(three_prompts())  # a first token undone, no logprobs asked
    tx.commit(Sampled([0, 1, 2], [7, 8, 9], [None, None, None]))
    tx.undo()
    assert all(s.num_output_tokens == 0 and s.first_token_time is None for s in tx.scheduler.waiting)


def test_an_undone_step_gives_a_seeded_request_its_random_state_back() -> None:
    run = FakeRun(FCFS(), budget(4, 64), WholePrompt())
    seq = run.seqs["s"] = Sequence("s", [5, 5, 5], Params(seed=3, temperature=1.0))
    run.sched.add(seq)
    first = torch.rand(3, generator=torch.Generator().manual_seed(3))
    tx, plan = transaction(run)
    assert plan.rows[0].generator is seq.generator
    drawn = torch.rand(3, generator=seq.generator)  # the sampler draws, then the step fails
    tx.undo()
    assert torch.equal(drawn, first) and torch.equal(torch.rand(3, generator=seq.generator), first)


def test_an_undone_step_leaves_a_swapped_out_request_swapped_out_with_its_host_copy() -> None:
    run = FakeRun(FCFS(), budget(4, 64), WholePrompt(), Swap(), num_blocks=10, block_size=4, host_blocks=8)
    for rid in "abcd":
        run.add(rid, prompt_len=7, max_new=12)
    while not run.sched.swapped:
        run.step()
    before = {
        r: (s.status, s.num_computed_tokens, list(run.blocks.host_blocks_of(s))) for r, s in run.seqs.items()
    }
    tx, _ = transaction(run)
    tx.undo()
    assert {
        r: (s.status, s.num_computed_tokens, list(run.blocks.host_blocks_of(s))) for r, s in run.seqs.items()
    } == before


def test_an_undone_step_cuts_a_request_back_before_its_block_that_a_swap_in_of_the_step_overwrote() -> None:
    """r1 is evicted to make room and a swapped-out request is copied into its freed block in the same step:
    undone, r1 keeps only its blocks before that one (the copy has overwritten it)."""
    pre = ChunkedPrefill(ChunkedPrefillParams(chunk_size=4))
    run = FakeRun(FCFS(), budget(4, 64), pre, Swap(), num_blocks=5, block_size=4, host_blocks=2)
    for rid, prompt in (("r0", 6), ("r1", 2), ("r2", 2)):
        run.add(rid, prompt_len=prompt, max_new=10)
    for _ in range(7):
        run.step()
    r1 = run.seqs["r1"]
    table, computed = list(r1.block_table), r1.num_computed_tokens
    tx, _ = transaction(run)
    copied_into = {device for _, device in tx.out.swap_in}
    assert r1 in tx.out.preempted and copied_into & set(table) == {table[0]} and computed == 8
    tx.undo()
    assert (r1.status, r1.block_table, r1.num_computed_tokens) == (SequenceStatus.RUNNING, [], 0)
