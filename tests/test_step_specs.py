"""The step's rules at their edges: the progress guarantee's count, decode rows, swap pairs, preempted results.

``test_plan_rules`` breaks each rule of the plan check once; these pin where
each rule's edge lies: how many steps without progress the engine allows and
what its error says, that the first generated token fed back is a decode row
while a prompt's last token is not, that a negative block number is no block,
and that a preempted request is reported to the policies with nothing computed.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import ClassVar

import pytest
from support import PROMPTS

from cbcore import Engine, EngineConfig, SamplingParams
from cbcore.plugins import load_class
from cbcore.policies import FCFS
from cbcore.scheduling.block_manager import BlockManager
from cbcore.scheduling.sampling_params import SamplingParams as Params
from cbcore.scheduling.scheduler import ScheduledSeq, SchedulerError, SchedulerOutput, SchedulerStall
from cbcore.scheduling.sequence import Sequence, SequenceStatus
from cbcore.scheduling.step import MAX_IDLE_STEPS, Steps, check_plan

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
