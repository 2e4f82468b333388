"""Drive a :class:`~cbcore.scheduling.policy_scheduler.PolicyScheduler` without a model.

A policy's decisions can be tested in milliseconds: :class:`FakeRun` builds the
real scheduler over a :class:`~cbcore.scheduling.block_manager.BlockManager`
with a clock it advances by ``dt`` per step, and does what the engine does
around the model. Every plan goes through the engine's step transaction, so a
plan the engine would refuse fails here too; then the fake model applies the
swap copies, advances ``num_computed_tokens``, appends a token when a
sequence's pending tokens are all computed, finishes it at ``max_new_tokens``,
and reports the step's :class:`~cbcore.scheduling.policy.StepResult`s (the
preempted included) to the policies' events. After every step the block
manager's books are audited.

With ``kv=True`` it also writes a value unique to (request, position) into a
real :class:`~cbcore.execution.kv_cache.KVCache` for every computed token and
checks, before each step, that every earlier position of every scheduled
sequence still holds its value: what attention would read.

::

    run = FakeRun(MyQueue(), budget(max_seqs=2), WholePrompt())
    run.add("a", prompt_len=8, max_new=4)
    run.run()
    assert [rid for step in run.steps for rid in step.first_time] == [...]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from cbcore.execution.kv_cache import KVCache
from cbcore.policies import FCFS, ChunkedPrefill, Recompute, TokenBudget
from cbcore.policies.token_budget import TokenBudgetParams
from cbcore.scheduling.block_manager import BlockManager
from cbcore.scheduling.door import Door
from cbcore.scheduling.plan import StepPlan
from cbcore.scheduling.policy import BudgetPolicy, PreemptionPolicy, PrefillPolicy, QueuePolicy, StepResult
from cbcore.scheduling.policy_scheduler import PolicyScheduler
from cbcore.scheduling.sampling_params import SamplingParams
from cbcore.scheduling.scheduler import SchedulerOutput
from cbcore.scheduling.sequence import FinishReason, Sequence
from cbcore.scheduling.step import Steps, StepTransaction
from cbcore.testing.block_invariants import check_blocks

__all__ = ["TOKEN", "FakeRun", "Step", "budget"]

#: The token the fake model samples, always.
TOKEN = 7


@dataclass
class Step:
    """What one step did."""

    out: SchedulerOutput
    plan: StepPlan
    sampled: list[str]  # request ids that produced a token
    chunks: list[tuple[str, int, bool]]  # (request id, tokens, final chunk of what was pending)
    first_time: list[str]  # request ids scheduled for the first time


class FakeRun:
    """The scheduler of the four given policies (defaults: fcfs, token-budget, chunked-prefill, recompute),
    driven step by step; ``steps`` records what each step did."""

    def __init__(
        self,
        queue: QueuePolicy | None = None,
        budget: BudgetPolicy | None = None,
        prefill: PrefillPolicy | None = None,
        preemption: PreemptionPolicy | None = None,
        *,
        num_blocks: int = 256,
        block_size: int = 4,
        host_blocks: int = 0,
        prefix_caching: bool = False,
        kv: bool = False,
        dt: float = 1.0,
        order: str = "decode-first",
    ) -> None:
        self.now = 0.0
        self.dt = dt
        self.blocks = BlockManager(num_blocks, block_size, host_blocks, prefix_caching=prefix_caching)
        door = Door(queue or FCFS(), budget or TokenBudget(), prefill or ChunkedPrefill(), preemption or Recompute())
        self.sched = PolicyScheduler(door, self.blocks, clock=lambda: self.now, order=order)
        self.rules = Steps(self.sched, door.culprit, lambda: self.now)
        self.kv = KVCache(2, num_blocks, block_size, 1, 2, torch.float32, "cpu", host_blocks) if kv else None
        self.seqs: dict[str, Sequence] = {}
        self.steps: list[Step] = []
        self.served: dict[str, float] = {}  # client -> prompt tokens computed + 2 x tokens generated
        self._started: set[str] = set()

    def add(
        self, rid: str, prompt_len: int, max_new: int = 4, *, priority: int = 0, client: str = "default"
    ) -> Sequence:
        """A request of ``prompt_len`` tokens that generates ``max_new``, arriving now."""
        seq = Sequence(
            request_id=rid,
            prompt_token_ids=[5] * prompt_len,
            params=SamplingParams(max_new_tokens=max_new, ignore_eos=True),
            priority=priority,
            client_id=client,
            arrival_time=self.now,
        )
        self.seqs[rid] = seq
        self.sched.add(seq)
        return seq

    def step(self) -> Step:
        """Plan one step, check the plan as the engine does, run the fake model, tell the policies."""
        # Through the engine's step transaction: every plan is checked as the engine checks it.
        tx = StepTransaction(self.rules, [s for s in self.seqs.values() if not s.is_finished])
        out = self.sched.schedule()
        plan = tx.check(out)
        if self.kv is not None:
            self.kv.copy_out(out.swap_out)
            self.kv.copy_in(out.swap_in)
            self._forward(out)
        record = Step(out, plan, [], [], [])
        results = []
        for item in out.scheduled:
            seq, n = item.seq, item.num_tokens
            final = seq.num_computed_tokens + n == seq.num_tokens
            record.chunks.append((seq.request_id, n, final))
            if seq.request_id not in self._started:
                self._started.add(seq.request_id)
                record.first_time.append(seq.request_id)
            prompt_before = min(seq.num_computed_tokens, seq.num_prompt_tokens)
            seq.num_computed_tokens += n
            prompt_new = min(seq.num_computed_tokens, seq.num_prompt_tokens) - prompt_before
            self.served[seq.client_id] = self.served.get(seq.client_id, 0.0) + max(prompt_new, 0)
            token = None
            if final:
                token = TOKEN
                seq.append_token(token, self.now)
                record.sampled.append(seq.request_id)
                self.served[seq.client_id] += 2
                if seq.num_output_tokens >= seq.params.max_new_tokens:
                    seq.finish(FinishReason.LENGTH, self.now)
            results.append(StepResult(seq.view, n, token))
        results += [StepResult(seq.view, 0, None, True) for seq in out.preempted]
        self.sched.on_step_end(out, results)
        check_blocks(self.blocks, self.sched.running)
        self.steps.append(record)
        self.now += self.dt
        return record

    def run(self, max_steps: int = 5000, each: Callable[[FakeRun], None] | None = None) -> None:
        """Step until nothing is left (``each`` is called before every step, e.g. to add arrivals)."""
        while self.sched.has_unfinished():
            if len(self.steps) >= max_steps:
                raise AssertionError(f"not finished after {max_steps} steps")
            if each is not None:
                each(self)
            self.step()

    # -- the fake model's KV traffic -------------------------------------------

    def _value(self, seq: Sequence, pos: int) -> float:
        return float(list(self.seqs).index(seq.request_id) * 1000 + pos + 1)

    def _slots(self, seq: Sequence, positions: range) -> torch.Tensor:
        bs = self.blocks.block_size
        return torch.tensor([seq.block_table[p // bs] * bs + p % bs for p in positions], dtype=torch.long)

    def _forward(self, out: SchedulerOutput) -> None:
        assert self.kv is not None
        for item in out.scheduled:
            seq = item.seq
            start = seq.num_computed_tokens
            if start:
                k, v = self.kv.gather(1, self._slots(seq, range(start)))
                want = torch.tensor([self._value(seq, p) for p in range(start)])
                assert torch.equal(k[:, 0, 0], want), f"{seq.request_id}: cached keys lost"
                assert torch.equal(v[:, 0, 1], -want), f"{seq.request_id}: cached values lost"
            new = range(start, start + item.num_tokens)
            vals = torch.tensor([self._value(seq, p) for p in new])
            slots = self._slots(seq, new)
            for layer in range(self.kv.num_layers):
                k = vals[:, None, None].expand(len(new), 1, 2).clone()
                self.kv.write(layer, slots, k, -k)


def budget(max_seqs: int = 16, max_tokens: int = 512) -> TokenBudget:
    """A ``token-budget`` policy of ``max_seqs`` sequences and ``max_tokens`` tokens a step."""
    return TokenBudget(TokenBudgetParams(max_num_seqs=max_seqs, max_num_batched_tokens=max_tokens))
