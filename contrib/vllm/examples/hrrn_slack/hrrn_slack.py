"""Highest response ratio next, and "most slack to its deadline" as the preemption victim.

An outside plugin package, written as docs/policies.md shows (a module with
an entry point in group ``cbcore``), used to check that vLLM with
cbcore_vllm follows a plugin nobody wrote for it (docs/vllm.md, "Check your
own plugin").
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field

from cbcore import PreemptionPolicy, QueuePolicy, hookimpl


class HrrnParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    token_s: float = Field(0.01, gt=0, description="Expected seconds of service per token (prompt and output).")


class Hrrn(QueuePolicy):
    """Highest (waiting + service) / service first: short requests early, long ones not starved."""

    name = "hrrn"
    Params = HrrnParams

    def key(self, seq, now):
        service = (seq.num_prompt_tokens + seq.params.max_new_tokens) * self.params.token_s
        ratio = (now - seq.arrival_time + service) / service
        return (-ratio, seq.arrival_time, seq.request_id)


class SlackParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    token_s: float = Field(0.01, gt=0, description="Expected seconds per output token still to generate.")


class MostSlack(PreemptionPolicy):
    """Recompute the candidate that can best afford it: the most time to spare before its deadline."""

    name = "most-slack"
    Params = SlackParams

    def slack(self, seq, now):
        if seq.deadline is None:
            return math.inf  # no deadline: all the slack in the world
        left = seq.params.max_new_tokens - seq.num_output_tokens
        return seq.deadline - now - left * self.params.token_s

    def choose_victim(self, candidates, queue, now):
        return max(candidates, key=lambda s: (self.slack(s, now), s.request_id))


@hookimpl
def cbcore_register_policies():
    return [Hrrn, MostSlack]
