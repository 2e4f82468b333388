"""Per-request decoding parameters."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class SamplingParams(BaseModel):
    """How one request is decoded.

    Every request carries its own parameters (and its own RNG, seeded from
    ``seed``), so what it generates never depends on what else shares the batch.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_new_tokens: int = Field(16, ge=1, description="Upper bound on generated tokens.")
    temperature: float = Field(0.0, ge=0.0, description="0 means greedy (argmax).")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens; 0 disables.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass; 1.0 disables.")
    seed: int | None = Field(None, description="Seed of this request's own generator.")
    stop_token_ids: tuple[int, ...] = Field((), description="Extra token ids that end the request.")
    ignore_eos: bool = Field(False, description="Keep generating past the model's EOS token.")
    logprobs: int | None = Field(
        None, ge=0, le=20, description="Return this many top log-probabilities per generated token."
    )

    @model_validator(mode="after")
    def _check_sampling(self) -> SamplingParams:
        if self.temperature == 0.0 and (self.top_k or self.top_p < 1.0):
            # Silently ignoring them would hide a misconfiguration.
            raise ValueError("top_k/top_p only apply when temperature > 0 (temperature=0 is greedy)")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
