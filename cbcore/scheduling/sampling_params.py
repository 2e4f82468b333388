"""Per-request decoding parameters."""

from __future__ import annotations

from functools import cached_property
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

#: Temperatures below this are greedy: dividing logits by a smaller number
#: overflows float32 (1e-38 turns every logit into inf), and at this scale
#: sampling already picks the argmax whenever the top two logits differ by
#: more than ~1e-3.
GREEDY_BELOW = 1e-5
MAX_TEMPERATURE = 100.0


class SamplingParams(BaseModel):
    """How one request is decoded.

    Every request carries its own parameters (and its own RNG, seeded from
    ``seed``), so what it generates never depends on what else shares the batch.
    """

    # Strict: "5" is not 5 and True is not 1.0 (ints are accepted where floats are asked).
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    max_new_tokens: int = Field(16, ge=1, description="Upper bound on generated tokens.")
    temperature: float = Field(
        0.0,
        ge=0.0,
        le=MAX_TEMPERATURE,
        allow_inf_nan=False,
        description=f"0 means greedy (argmax); so does any value below {GREEDY_BELOW}.",
    )
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens; 0 disables.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False, description="Nucleus sampling mass; 1.0 disables.")
    seed: int | None = Field(None, ge=0, lt=2**64, description="Seed of this request's own generator, in [0, 2**64).")
    stop_token_ids: tuple[StrictInt, ...] = Field(
        (), strict=False, description="Extra token ids that end the request (checked against the vocabulary)."
    )
    ignore_eos: bool = Field(False, description="Keep generating past the model's EOS token.")
    logprobs: int | None = Field(
        None, ge=0, le=20, description="Return this many top log-probabilities per generated token."
    )

    @model_validator(mode="after")
    def _check_sampling(self) -> SamplingParams:
        if self.greedy and (self.top_k or self.top_p < 1.0):
            # Silently ignoring them would hide a misconfiguration.
            raise ValueError(
                f"top_k/top_p only apply when temperature >= {GREEDY_BELOW} (below it decoding is greedy)"
            )
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids holds a negative id")
        return self

    @cached_property
    def greedy(self) -> bool:
        """Decided once, when the params are validated (the sampler reads it for every row of every step)."""
        return self.temperature < GREEDY_BELOW

    def model_copy(self, *, update: dict[str, Any] | None = None, deep: bool = False) -> SamplingParams:
        """A copy with ``update`` applied, validated again like any SamplingParams."""
        return type(self).model_validate(self.model_dump() | (update or {}))
