"""What a step costs depends on its shape: tokens, sequences, attention work, sampled rows."""

from __future__ import annotations

from dataclasses import dataclass

from cbcore.scheduling.plan import StepPlan


@dataclass(frozen=True, slots=True)
class StepShape:
    """The quantities a step-time model reads, computed from the step's plan alone."""

    num_seqs: int
    prefill_tokens: int  # prompt or recomputed tokens (every token that is not a decode)
    decode_tokens: int
    attn_pairs: int  # query-key pairs: sum over rows of n*start + n(n+1)/2
    kv_tokens: int  # keys read: sum over rows of start + n
    sample_rows: tuple[int, ...]  # indices in the plan of the rows that sample
    swap_blocks: int = 0

    @property
    def num_tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens

    @property
    def num_samples(self) -> int:
        return len(self.sample_rows)

    @classmethod
    def of(cls, plan: StepPlan) -> StepShape:
        prefill = decode = pairs = keys = 0
        rows = []
        for i, row in enumerate(plan.rows):
            n, start = len(row.token_ids), row.start
            if row.decode:
                decode += 1
            else:
                prefill += n
            pairs += n * start + n * (n + 1) // 2
            keys += start + n
            if row.params is not None:
                rows.append(i)
        return cls(
            num_seqs=len(plan.rows),
            prefill_tokens=prefill,
            decode_tokens=decode,
            attn_pairs=pairs,
            kv_tokens=keys,
            sample_rows=tuple(rows),
            swap_blocks=len(plan.swap_in) + len(plan.swap_out),
        )
