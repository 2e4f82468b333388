"""A per-step cap on sequences and tokens, shared by prefill and decode."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from cbcore.scheduling.policy import BudgetPolicy, SchedulerState, StepLimits


class TokenBudgetParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_num_seqs: int = Field(16, ge=1, description="Most sequences running at once.")
    max_num_batched_tokens: int = Field(
        512, ge=1, description="Most tokens (prefill + decode) in one forward."
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
