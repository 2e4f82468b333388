"""What a step costs depends on its shape: tokens, sequences, attention work, sampled rows."""

from __future__ import annotations

from dataclasses import dataclass

from cbcore.scheduling.scheduler import SchedulerOutput


@dataclass(frozen=True, slots=True)
class StepShape:
    """The quantities a step-time model reads, computed from the scheduler's decision alone."""

    num_seqs: int
    prefill_tokens: int  # prompt or recomputed tokens (every token that is not a decode)
    decode_tokens: int
    attn_pairs: int  # query-key pairs: sum over rows of n*start + n(n+1)/2
    kv_tokens: int  # keys read: sum over rows of start + n
    sample_rows: tuple[int, ...]  # indices in the schedule of the rows that sample
    swap_blocks: int = 0

    @property
    def num_tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens

    @property
    def num_samples(self) -> int:
        return len(self.sample_rows)

    @classmethod
    def of(cls, out: SchedulerOutput) -> StepShape:
        prefill = decode = pairs = keys = 0
        rows = []
        for i, item in enumerate(out.scheduled):
            seq, n = item.seq, item.num_tokens
            start = seq.num_computed_tokens
            if item.is_decode:
                decode += 1
            else:
                prefill += n
            pairs += n * start + n * (n + 1) // 2
            keys += start + n
            if start + n == len(seq.token_ids):
                rows.append(i)
        return cls(
            num_seqs=len(out.scheduled),
            prefill_tokens=prefill,
            decode_tokens=decode,
            attn_pairs=pairs,
            kv_tokens=keys,
            sample_rows=tuple(rows),
            swap_blocks=len(out.swap_in) + len(out.swap_out),
        )
