"""File plugins for the adapter tests: policies whose decisions differ from vLLM's built-ins,
and that append what they saw to a JSON-lines file (the test reads it from another process).
"""

from __future__ import annotations

import json
from collections.abc import Sequence as Seq

from pydantic import BaseModel, ConfigDict

from cbcore import PreemptionPolicy, QueuePolicy, StepResult, hookimpl


class LogParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    log: str | None = None  # JSON-lines path for the events this policy sees


def _write(path: str | None, **event: object) -> None:
    if path is not None:
        with open(path, "a") as f:
            f.write(json.dumps(event) + "\n")


class LongestPromptFirst(QueuePolicy):
    """Longest prompt first (never what fcfs or priority would do), logging every event it gets."""

    name = "longest-prompt-first"
    Params = LogParams

    def key(self, seq, now):
        return (-seq.num_prompt_tokens, seq.arrival_time, seq.request_id)

    def on_arrival(self, seq, now):
        _write(
            self.params.log,
            event="arrival",
            id=seq.request_id,
            client_id=seq.client_id,
            deadline_s=seq.deadline_s,
            deadline=seq.deadline,
            attrs=dict(seq.attrs),
            priority=seq.priority,
            max_new_tokens=seq.params.max_new_tokens,
            num_prompt_tokens=seq.num_prompt_tokens,
            arrival_time=seq.arrival_time,
        )

    def on_step_end(self, results: Seq[StepResult], now):
        for r in results:
            if r.preempted:
                _write(self.params.log, event="preempt", id=r.seq.request_id)
        rows = [[r.seq.request_id, r.num_computed, r.new_token] for r in results if not r.preempted]
        _write(self.params.log, event="step_end", now=now, rows=rows)

    def on_finish(self, seq, now):
        _write(self.params.log, event="finish", now=now, id=seq.request_id, num_output_tokens=seq.num_output_tokens)


class EvictLongestPrompt(PreemptionPolicy):
    """Recompute the candidate with the longest prompt (vLLM's fcfs would evict the newest)."""

    name = "evict-longest-prompt"
    Params = LogParams

    def choose_victim(self, candidates, queue, now):
        victim = max(candidates, key=lambda s: (s.num_prompt_tokens, s.request_id))
        _write(self.params.log, event="victim", id=victim.request_id, candidates=[c.request_id for c in candidates])
        return victim


class GarbageOrder(QueuePolicy):
    """A broken queue: order() drops a request once two wait."""

    name = "garbage-order"

    def order(self, seqs, now):
        return list(seqs)[1:] if len(seqs) > 1 else list(seqs)


class RaiseOnFive(QueuePolicy):
    """A broken queue: key() divides by zero for a prompt of five tokens."""

    name = "raise-on-five"

    def key(self, seq, now):
        return (1 / (seq.num_prompt_tokens - 5), seq.request_id)


class EngineDependent(QueuePolicy):
    """Oldest first in cbcore's engine, newest first inside vLLM (it tells the engines apart by the view's
    type): a divergence no documented difference explains, which the decision check must flag."""

    name = "engine-dependent"

    def key(self, seq, now):
        sign = -1 if type(seq).__name__ == "RequestView" else 1
        return (sign * seq.arrival_time, seq.request_id)


@hookimpl
def cbcore_register_policies():
    return [LongestPromptFirst, EvictLongestPrompt, GarbageOrder, RaiseOnFive, EngineDependent]
