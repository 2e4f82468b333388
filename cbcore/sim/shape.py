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
        """The shape of ``plan``, in a few C-level passes over its rows: called once per simulated step.

        A decode row computes one token at position ``start`` (``start + 1`` query-key pairs and
        keys) and samples; only the other rows (prefill chunks, recomputation) are looked at one by
        one. A trace hour is ~10^5 steps of ~10^2 rows, so this is the simulator's own inner loop.
        """
        rows = plan.rows
        swaps = len(plan.swap_in) + len(plan.swap_out)
        starts = [r.start for r in rows]
        decodes = [r.decode for r in rows]
        n_decode = decodes.count(True)
        keys = sum(starts) + n_decode
        if n_decode == len(rows):  # decode-only: the common step of a busy engine
            return cls(n_decode, 0, n_decode, keys, keys, tuple(range(n_decode)), swaps)
        prefill = 0
        pairs = keys  # every row's start, plus 1 per decode row; the other rows are added below
        for i in [i for i, d in enumerate(decodes) if not d]:
            n, start = len(rows[i].token_ids), starts[i]
            prefill += n
            pairs += n * start + n * (n + 1) // 2 - start
        sample = tuple([i for i, r in enumerate(rows) if r.params is not None])
        return cls(len(rows), prefill, n_decode, pairs, keys + prefill, sample, swaps)
