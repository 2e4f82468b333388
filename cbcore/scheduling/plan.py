"""The plan of one step as the execution side reads it: plain data, no scheduler objects.

The scheduler decides with :class:`~cbcore.scheduling.sequence.Sequence` objects;
the step transaction turns its decision into this plan, and the executor (the
runner and sampler, or the simulator's cost model) sees nothing else and
returns :class:`Sampled`. So execution code cannot reach into a sequence's state, and a
scheduler can change its bookkeeping without touching the runner.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch

    from cbcore.scheduling.sampling_params import SamplingParams


class RowPlan(NamedTuple):
    """One sequence's share of the step (a named tuple: read-only, and built 3x faster than a frozen dataclass)."""

    token_ids: list[int]  # the tokens computed this step
    start: int  # position of the first of them (= tokens of this sequence already in the KV cache)
    block_table: list[int]  # the sequence's KV blocks, covering start + len(token_ids) tokens
    # Set when the row's last token is the sequence's last (its logits pick the next token);
    # None for a prefill chunk that is not the last.
    params: SamplingParams | None = None
    generator: torch.Generator | None = None  # the request's own RNG, when it is seeded
    decode: bool = False  # one generated token fed back (not prompt or recomputed tokens)


@dataclass(frozen=True, slots=True)
class StepPlan:
    rows: list[RowPlan] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    num_tokens: int = 0
    num_decode_tokens: int = 0


@dataclass
class Sampled:
    """What execution gives back: one token per sampling row of the plan."""

    rows: list[int]  # indices into StepPlan.rows of the rows that sampled
    tokens: list[int]
    logprobs: list[dict[int, float] | None]
    # Per row, why its sampling failed (that request alone ends with an error), or None.
    errors: list[str | None] | None = None
