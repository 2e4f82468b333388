"""Testing helpers: tiny models, the per-prompt reference and the comparison; the scheduler without a model.

The contract (docs/equivalence.md): for float32 greedy decoding every
request's tokens equal HF ``generate()`` on that prompt alone; the only
tolerated difference is a genuine near-tie, where at the first divergent
position the two candidates' logits differ by less than ``NEAR_TIE``.
"""

from __future__ import annotations

from cbcore.testing.check import run_equivalence
from cbcore.testing.compare import (
    NEAR_TIE,
    Comparison,
    EquivalenceReport,
    assert_equivalent,
    compare_greedy,
    compare_topk,
)
from cbcore.testing.fake_run import FakeRun, budget
from cbcore.testing.reference import reference_generate
from cbcore.testing.tiny_models import TINY_FAMILIES, random_prompts, shared_prefix_prompts, tiny_model

__all__ = [
    "NEAR_TIE",
    "TINY_FAMILIES",
    "Comparison",
    "EquivalenceReport",
    "FakeRun",
    "assert_equivalent",
    "budget",
    "compare_greedy",
    "compare_topk",
    "random_prompts",
    "reference_generate",
    "run_equivalence",
    "shared_prefix_prompts",
    "tiny_model",
]
