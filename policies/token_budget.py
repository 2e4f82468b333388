"""A per-step cap on sequences and tokens, shared by prefill and decode."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from cbcore.scheduling.policy import BudgetPolicy, SchedulerState, StepLimits


class TokenBudgetParams(BaseModel):
    """The defaults are vLLM's for its OpenAI server on a CPU: the prompts that arrive together are
    prefilled together, so running requests' decodes are seldom slowed by a prefill (inter-token
    latency) at the price of a long first step for a crowd (time to first token). docs/benchmarks.md
    measures this against smaller budgets."""

    model_config = ConfigDict(extra="forbid")

    max_num_seqs: int = Field(128, ge=1, description="Most sequences running at once.")
    max_num_batched_tokens: int = Field(
        2048, ge=1, description="Most tokens (prefill + decode) in one forward."
    )


class TokenBudget(BudgetPolicy):
    """One token budget for the whole step: decodes cost 1, prefills their chunk.

    Admission is otherwise free: a waiting request joins as soon as a slot, the
    budget and the KV cache allow (iteration-level scheduling).
    """

    name = "token-budget"
    Params = TokenBudgetParams

    def limits(self, state: SchedulerState) -> StepLimits:
        return StepLimits(self.params.max_num_seqs, self.params.max_num_batched_tokens)
