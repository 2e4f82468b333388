"""Cost of one ``schedule()`` with 1,000 waiting and 256 running sequences, per built-in policy.

``pytest tests/benchmarks/test_bench_scheduler.py --benchmark-enable`` times
it; without ``--benchmark-enable`` (the default addopts) each case runs once
as a plain test of the setup. No model is involved: the scheduler only sees
sequences and block bookkeeping.

Each case puts one built-in policy in its slot and keeps the defaults in the
others (fcfs, token-budget, chunked-prefill, recompute). The budget allows 512
sequences and 2,048 tokens, so the step schedules all 256 decodes and then
admits waiting prompts (chunked) until the token budget is spent. The
``tight`` cases give the KV cache only 64 free blocks while every running
sequence sits on a block boundary, so most decodes force a preemption.
"""

from __future__ import annotations

import pytest

from cbcore.plugins import get_registry
from cbcore.scheduling.block_manager import BlockManager
from cbcore.scheduling.door import Door
from cbcore.scheduling.plan import RowPlan, StepPlan
from cbcore.scheduling.policy_scheduler import PolicyScheduler
from cbcore.scheduling.sampling_params import SamplingParams
from cbcore.scheduling.scheduler import SchedulerOutput
from cbcore.scheduling.sequence import Sequence, SequenceStatus
from cbcore.scheduling.step import check_plan

NUM_WAITING = 1000
NUM_RUNNING = 256
PROMPT = 64  # tokens of a running sequence's prompt: four blocks of 16
BLOCK_SIZE = 16
DEFAULTS = {
    "queue": "fcfs",
    "budget": "token-budget",
    "prefill": "chunked-prefill",
    "preemption": "recompute",
}
BUDGET = {"max_num_seqs": 512, "max_num_batched_tokens": 2048}
PARAMS = {"token-budget": BUDGET, "static": BUDGET}

CASES = [(kind, name, "roomy") for kind, name in DEFAULTS.items()]
CASES += [("queue", "priority", "roomy"), ("queue", "lpm", "roomy"), ("budget", "static", "roomy"), ("prefill", "whole-prompt", "roomy")]
CASES += [("preemption", "recompute", "tight"), ("preemption", "swap", "tight")]


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1e-6
        return self.t


def prompt_len(i: int, memory: str) -> int:
    if i >= NUM_RUNNING:
        return 16 + i % 200  # waiting prompts of 16..215 tokens
    # Running: on a block boundary (the next token needs a new block) when memory is tight,
    # else spread over block offsets as in a steady state (one in 16 needs a block).
    return PROMPT if memory == "tight" else PROMPT + i % BLOCK_SIZE


def make_scheduler(kind: str, name: str, memory: str, params: dict | None = None) -> PolicyScheduler:
    """The defaults with ``name`` in slot ``kind`` (given ``params``, else PARAMS'), loaded as described above."""
    registry = get_registry()
    names = {**DEFAULTS, kind: name}
    given = {policy: PARAMS.get(policy, {}) for policy in names.values()} | ({name: params} if params else {})
    policies = {
        slot: registry.create(slot, policy, given[policy], f"scheduler.{slot}") for slot, policy in names.items()
    }
    running_blocks = sum(-(-prompt_len(i, memory) // BLOCK_SIZE) for i in range(NUM_RUNNING))
    spare = 64 if memory == "tight" else 100_000
    blocks = BlockManager(running_blocks + spare, BLOCK_SIZE, num_host_blocks=running_blocks)
    clock = Clock()
    sched = PolicyScheduler(Door(**policies), blocks, clock)
    params = SamplingParams(max_new_tokens=128)
    for i in range(NUM_RUNNING + NUM_WAITING):
        prompt = [3 + (i * 7 + j) % 500 for j in range(prompt_len(i, memory))]
        sched.add(
            Sequence(f"r{i}", prompt, params, priority=i % 3, client_id=f"c{i % 4}", arrival_time=i * 1e-3)
        )
    # The first NUM_RUNNING are mid-decode: prompt computed and one token generated.
    running, sched.waiting = sched.waiting[:NUM_RUNNING], sched.waiting[NUM_RUNNING:]
    for seq in running:
        seq.status = SequenceStatus.RUNNING
        seq.first_scheduled_time = clock()
        blocks.grow(seq, seq.num_prompt_tokens)
        seq.num_computed_tokens = seq.num_prompt_tokens
        seq.append_token(7, clock())
        sched.running.append(seq)
    return sched


@pytest.mark.parametrize(("kind", "name", "memory"), CASES, ids=[f"{k}={n}-{m}" for k, n, m in CASES])
def test_schedule_cost(benchmark, kind: str, name: str, memory: str) -> None:
    out = benchmark.pedantic(
        lambda s: s.schedule(), setup=lambda: ((make_scheduler(kind, name, memory),), {}), rounds=15
    )
    decodes = sum(1 for s in out.scheduled if s.num_tokens == s.seq.num_pending_tokens == 1 and s.seq.num_output_tokens)
    if memory == "roomy":
        assert decodes == NUM_RUNNING
        assert sum(s.num_tokens for s in out.scheduled) == BUDGET["max_num_batched_tokens"] or name == "whole-prompt"
        assert len(out.scheduled) > NUM_RUNNING  # waiting prompts were admitted too
    else:
        assert out.preempted and decodes + len(out.preempted) == NUM_RUNNING
        assert out.swap_out if name == "swap" else not out.swap_out


def _unchecked_plan(out: SchedulerOutput) -> StepPlan:
    """The plan built without the engine's checks: what the check's cost is measured against."""
    rows = []
    for item in out.scheduled:
        seq, n = item.seq, item.num_tokens
        start = seq.num_computed_tokens
        samples = start + n == seq.num_tokens
        rows.append(
            RowPlan(
                seq.token_ids[start : start + n],
                start,
                seq.block_table,
                seq.params if samples else None,
                seq.generator if samples else None,
            )
        )
    return StepPlan(rows, out.swap_out, out.swap_in)


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "unchecked"])
def test_plan_check_cost(benchmark, checked: bool) -> None:
    """The engine's plan check, fused with building the plan, at 256 running + admissions.

    Its cost is ``checked - unchecked``, to be read against ``test_schedule_cost``
    (defaults) from the same run.
    """
    sched = make_scheduler("queue", "fcfs", "roomy")
    out = sched.schedule()
    blocks = sched.blocks
    if checked:
        plan, tokens, _ = benchmark(check_plan, out, blocks, "bench")
        assert tokens == sum(s.num_tokens for s in out.scheduled)
    else:
        plan = benchmark(_unchecked_plan, out)
    assert len(plan.rows) == len(out.scheduled) > NUM_RUNNING
