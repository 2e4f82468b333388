"""Comparing engine outputs with the reference, per request, under the contract's rules."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import torch

from cbcore.outputs import RequestOutput
from cbcore.testing.reference import ReferenceOutput, next_token_logits

#: At the first divergent position the two candidates' logits must differ by
#: less than this for the divergence to count as a genuine near-tie.
NEAR_TIE = 1e-5


@dataclass(frozen=True)
class Comparison:
    index: int
    request_id: str
    reference_len: int
    engine_len: int
    position: int | None = None  # first divergent output position; None if identical
    expected: int | None = None  # reference token there (None: reference had ended)
    actual: int | None = None  # engine token there (None: engine had ended)
    logit_gap: float | None = None  # |logit(expected) - logit(actual)| under the reference model
    near_tie: bool = False
    error: str | None = None  # the engine reported an error for this request

    @property
    def identical(self) -> bool:
        return self.position is None and self.error is None

    @property
    def ok(self) -> bool:
        return self.identical or self.near_tie

    def describe(self) -> str:
        if self.error is not None:
            return f"engine error: {self.error}"
        if self.identical:
            return f"match ({self.engine_len} tokens)"
        where = f"first divergence at output token {self.position}"
        if self.expected is None or self.actual is None:
            ended = "reference" if self.expected is None else "engine"
            return f"{where}: the {ended} ended there (lengths {self.reference_len} vs {self.engine_len})"
        kind = "near-tie (tolerated)" if self.near_tie else "DIVERGED"
        # the top-k rule (half precision) compares ranks, not a logit gap
        gap = f"logit gap {self.logit_gap:.3g}" if self.logit_gap is not None else "top-k rule"
        return f"{kind}: {where}: expected {self.expected}, got {self.actual}, {gap}"


@dataclass(frozen=True)
class EquivalenceReport:
    comparisons: list[Comparison]
    engine: Any = field(default=None, repr=False, compare=False)  # the engine that produced the outputs

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.comparisons)

    @property
    def num_identical(self) -> int:
        return sum(c.identical for c in self.comparisons)

    @property
    def num_near_ties(self) -> int:
        return sum(c.near_tie for c in self.comparisons)

    @property
    def num_diverged(self) -> int:
        return sum(not c.ok for c in self.comparisons)

    def table(self) -> str:
        width = max([len("request")] + [len(c.request_id) for c in self.comparisons])
        lines = [f"{'#':>3}  {'request':<{width}}  result"]
        for c in self.comparisons:
            lines.append(f"{c.index:>3}  {c.request_id:<{width}}  {c.describe()}")
        lines.append(
            f"{self.num_identical} identical, {self.num_near_ties} near-tie, {self.num_diverged} diverged "
            f"of {len(self.comparisons)}"
        )
        return "\n".join(lines)


def _first_divergence(a: Seq[int], b: Seq[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_greedy(
    model: torch.nn.Module,
    engine_outputs: Seq[RequestOutput],
    references: Seq[ReferenceOutput],
    *,
    near_tie: float = NEAR_TIE,
) -> EquivalenceReport:
    """Exact match per request, or a near-tie measured under the reference model.

    At the first divergent position the prompt plus the common prefix is run
    through ``model`` alone and the gap between the two candidates' logits is
    read there; below ``near_tie`` the divergence is a genuine tie and is
    reported as such, anything else fails.
    """
    if len(engine_outputs) != len(references):
        raise ValueError(f"{len(engine_outputs)} engine outputs for {len(references)} references")
    comparisons = []
    for i, (out, ref) in enumerate(zip(engine_outputs, references, strict=True)):
        base = dict(
            index=i,
            request_id=out.request_id,
            reference_len=len(ref.token_ids),
            engine_len=len(out.output_token_ids),
        )
        if out.error is not None:
            comparisons.append(Comparison(**base, error=out.error))
            continue
        pos = _first_divergence(ref.token_ids, out.output_token_ids)
        if pos is None:
            comparisons.append(Comparison(**base))
            continue
        expected = ref.token_ids[pos] if pos < len(ref.token_ids) else None
        actual = out.output_token_ids[pos] if pos < len(out.output_token_ids) else None
        gap = None
        tie = False
        if expected is not None and actual is not None:
            logits = next_token_logits(model, list(out.prompt_token_ids) + ref.token_ids[:pos])
            gap = abs(float(logits[expected] - logits[actual]))
            tie = gap < near_tie
        comparisons.append(
            Comparison(**base, position=pos, expected=expected, actual=actual, logit_gap=gap, near_tie=tie)
        )
    return EquivalenceReport(comparisons)


def compare_topk(
    engine_outputs: Seq[RequestOutput], references: Seq[ReferenceOutput], k: int = 5
) -> EquivalenceReport:
    """Half-precision rule: at the first divergence each side's token is in the other's top-k.

    Needs engine outputs produced with ``SamplingParams(logprobs=k)`` and
    references from ``reference_generate(..., top_logprobs=k)``. After the
    first divergence the two continuations are unrelated, so nothing later is
    compared.
    """
    comparisons = []
    for i, (out, ref) in enumerate(zip(engine_outputs, references, strict=True)):
        base = dict(
            index=i,
            request_id=out.request_id,
            reference_len=len(ref.token_ids),
            engine_len=len(out.output_token_ids),
        )
        if out.error is not None:
            comparisons.append(Comparison(**base, error=out.error))
            continue
        if out.logprobs is None or ref.top_logprobs is None:
            raise ValueError("compare_topk needs engine logprobs and reference top_logprobs")
        pos = _first_divergence(ref.token_ids, out.output_token_ids)
        if pos is None:
            comparisons.append(Comparison(**base))
            continue
        expected = ref.token_ids[pos] if pos < len(ref.token_ids) else None
        actual = out.output_token_ids[pos] if pos < len(out.output_token_ids) else None
        close = False
        if expected is not None and actual is not None:
            ref_top = set(sorted(ref.top_logprobs[pos], key=ref.top_logprobs[pos].get, reverse=True)[:k])
            eng_top = set(sorted(out.logprobs[pos], key=out.logprobs[pos].get, reverse=True)[:k])
            close = actual in ref_top and expected in eng_top
        comparisons.append(Comparison(**base, position=pos, expected=expected, actual=actual, near_tie=close))
    return EquivalenceReport(comparisons)


def assert_equivalent(report: EquivalenceReport) -> None:
    if not report.ok:
        raise AssertionError("engine output differs from the per-prompt reference:\n" + report.table())
