"""Every rule of the engine's plan check, broken alone, gives its own named error.

Each case starts from one plan the check accepts (two running sequences,
one decoding, one mid-prompt, within a budget) and breaks exactly one rule;
the error must name that rule and the culprit, and nothing else may be
wrong with the plan. The progress rules are broken through ``Steps.observe``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from cbcore.scheduling.block_manager import BlockManager
from cbcore.scheduling.policy import StepLimits
from cbcore.scheduling.sampling_params import SamplingParams
from cbcore.scheduling.scheduler import ScheduledSeq, SchedulerError, SchedulerOutput, SchedulerStall
from cbcore.scheduling.sequence import Sequence, SequenceStatus
from cbcore.scheduling.step import Steps, check_plan

CULPRIT = "scheduler 'probe' (test)"


class Setup:
    def __init__(self) -> None:
        self.blocks = BlockManager(num_blocks=8, block_size=4, num_host_blocks=4)
        self.decode = self.running("decode", prompt=6, computed=6, output=1)  # one pending token
        self.prefill = self.running("prefill", prompt=8, computed=0)  # eight pending tokens
        self.waiting = Sequence("waiting", [1, 2, 3], SamplingParams())

    def running(self, rid: str, prompt: int, computed: int, output: int = 0) -> Sequence:
        seq = Sequence(rid, list(range(1, prompt + 1)), SamplingParams())
        seq.token_ids.extend([7] * output)
        seq.status = SequenceStatus.RUNNING
        seq.num_computed_tokens = computed
        self.blocks.grow(seq, seq.num_tokens - computed)
        return seq

    def out(self) -> SchedulerOutput:
        return SchedulerOutput(
            scheduled=[ScheduledSeq(self.decode, 1), ScheduledSeq(self.prefill, 4)],
            limits=StepLimits(max_num_seqs=2, max_num_tokens=5),
        )


def _not_a_plan(s: Setup) -> object:
    return [ScheduledSeq(s.decode, 1)]


def _not_a_sequence(s: Setup) -> SchedulerOutput:
    out = s.out()
    out.scheduled[0] = ScheduledSeq.__new__(ScheduledSeq)
    out.scheduled[0].seq, out.scheduled[0].num_tokens = "decode", 1  # type: ignore[assignment]
    return out


def _waiting(s: Setup) -> SchedulerOutput:
    out = s.out()
    s.blocks.grow(s.waiting, 3)
    out.scheduled[1] = ScheduledSeq(s.waiting, 3)
    return out


def _negative(s: Setup) -> SchedulerOutput:
    out = s.out()
    s.prefill.num_computed_tokens = -1
    return out


def _zero(s: Setup) -> SchedulerOutput:
    out = s.out()
    out.scheduled[1].num_tokens = 0
    return out


def _beyond_pending(s: Setup) -> SchedulerOutput:
    out = s.out()
    out.scheduled[0].num_tokens = 2
    out.limits = StepLimits(2, 8)
    return out


def _no_slot(s: Setup) -> SchedulerOutput:
    out = s.out()
    s.blocks.free(s.prefill)
    s.blocks.grow(s.prefill, 2)  # one block: 4 slots, the plan computes 4 -- then ask for 8
    out.scheduled[1].num_tokens = 8
    out.limits = StepLimits(2, 16)
    return out


def _not_int(s: Setup) -> SchedulerOutput:
    out = s.out()
    out.scheduled[1].num_tokens = np.int64(4)  # slices and compares like an int, sums to np.int64
    return out


def _twice(s: Setup) -> SchedulerOutput:
    out = s.out()
    out.scheduled.append(ScheduledSeq(s.decode, 1))
    out.limits = StepLimits(3, 6)
    return out


def _tokens_over_budget(s: Setup) -> SchedulerOutput:
    out = s.out()
    out.limits = StepLimits(max_num_seqs=2, max_num_tokens=4)
    return out


def _seqs_over_budget(s: Setup) -> SchedulerOutput:
    out = s.out()
    out.limits = StepLimits(max_num_seqs=1, max_num_tokens=5)
    return out


def _bad_swap_pair(s: Setup) -> SchedulerOutput:
    out = s.out()
    out.swap_out = [(0, 99)]  # host pool has 4 blocks
    return out


def _host_block_both_ways(s: Setup) -> SchedulerOutput:
    out = s.out()
    out.swap_out = [(0, 1)]
    out.swap_in = [(1, 2)]
    return out


RULES: dict[str, Callable[[Setup], object]] = {
    "schedule() returns a SchedulerOutput": _not_a_plan,
    "each scheduled entry is a ScheduledSeq of a Sequence and an int": _not_a_sequence,
    "only running sequences are scheduled": _waiting,
    "computed tokens are never negative": _negative,
    "a scheduled sequence computes at least 1 token": _zero,
    "tokens within the pending tokens": _beyond_pending,
    "a KV slot is allocated for every token": _no_slot,
    "token counts are ints": _not_int,
    "each sequence is scheduled at most once": _twice,
    "the step's tokens fit its budget": _tokens_over_budget,
    "the step's sequences fit its budget": _seqs_over_budget,
    "swap pairs name existing blocks": _bad_swap_pair,
    "no host block is swapped out and in in one step": _host_block_both_ways,
}


def test_the_unbroken_plan_passes() -> None:
    s = Setup()
    plan, tokens, sampled = check_plan(s.out(), s.blocks, CULPRIT)
    assert (tokens, sampled, len(plan.rows)) == (5, 1, 2)


@pytest.mark.parametrize("rule", list(RULES))
def test_each_rule_broken_alone_is_named(rule: str) -> None:
    s = Setup()
    out = RULES[rule](s)
    with pytest.raises(SchedulerError) as err:
        check_plan(out, s.blocks, CULPRIT)  # type: ignore[arg-type]
    assert err.value.rule == rule
    assert err.value.plugin == CULPRIT and CULPRIT in str(err.value)


class _Idle:
    """Just enough of a scheduler for the progress guard: blocks (observe is told that work waits)."""

    def __init__(self) -> None:
        self.blocks = BlockManager(num_blocks=2, block_size=4)



def test_a_step_that_computes_nothing_while_work_waits_is_a_stall() -> None:
    steps = Steps(_Idle(), CULPRIT, lambda: 0.0)
    with pytest.raises(SchedulerStall) as err:
        steps.observe(SchedulerOutput(), computed=0, sampled=0)
    assert err.value.rule == "a step computes tokens while work waits"


def test_preemptions_that_throw_all_progress_away_are_a_stall() -> None:
    steps = Steps(_Idle(), CULPRIT, lambda: 0.0)  # capacity 8 tokens: the window is 32
    out = SchedulerOutput()
    for _ in range(4):
        steps.observe(out, computed=8, sampled=0)
    with pytest.raises(SchedulerStall) as err:
        steps.observe(out, computed=1, sampled=0)
    assert err.value.rule == "preemptions do not undo all progress"
