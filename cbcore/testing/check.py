"""One call that runs an engine config against the per-prompt reference."""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as Seq
from typing import Any, Literal

import torch

from cbcore.config import EngineConfig
from cbcore.engine import Engine
from cbcore.scheduling.sampling_params import SamplingParams
from cbcore.testing.compare import EquivalenceReport, compare_greedy, compare_topk
from cbcore.testing.reference import reference_generate
from cbcore.testing.tiny_models import random_prompts, tiny_model

Rule = Literal["auto", "exact", "top5"]
HALF = (torch.float16, torch.bfloat16)


def run_equivalence(
    config: EngineConfig | dict[str, Any] | None = None,
    *,
    model: torch.nn.Module | None = None,
    tokenizer: Any = None,
    prompts: Seq[list[int] | str] | None = None,
    max_new_tokens: int | Seq[int] = 32,
    family: str = "llama",
    ignore_eos: bool = False,
    priorities: Seq[int] | None = None,
    client_ids: Seq[str] | None = None,
    deadlines_s: Seq[float | None] | None = None,
    attrs: Seq[Mapping[str, Any] | None] | None = None,
    rule: Rule = "auto",
) -> EquivalenceReport:
    """Run ``prompts`` through an engine built from ``config`` and through the reference.

    Defaults give a self-contained check for a plugin author: a tiny random
    ``family`` model and 16 random prompts of 1–64 tokens. ``rule`` is the
    contract's comparison: ``exact`` (float32: identical tokens or a genuine
    near-tie), ``top5`` (half precision: at the first divergence each side's
    token is in the other's top 5); ``auto`` picks by the model's dtype.
    """
    if not isinstance(config, EngineConfig):
        config = EngineConfig.model_validate(config or {})
    if model is None:
        model = tiny_model(family)
    if prompts is None:
        prompts = random_prompts(16, 1, 64, seed=0)
    if rule == "auto":
        rule = "top5" if next(model.parameters()).dtype in HALF else "exact"
    top = 5 if rule == "top5" else 0
    ids = [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
    caps = [max_new_tokens] * len(ids) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    references = reference_generate(model, ids, caps, ignore_eos=ignore_eos, top_logprobs=top)
    engine = Engine(model, tokenizer, config)
    params = [
        SamplingParams(max_new_tokens=c, ignore_eos=ignore_eos, logprobs=top if top else None) for c in caps
    ]
    outputs = engine.generate(
        ids, params, priorities=priorities, client_ids=client_ids, deadlines_s=deadlines_s, attrs=attrs
    )
    report = compare_topk(outputs, references, k=top) if top else compare_greedy(model, outputs, references)
    return EquivalenceReport(report.comparisons, engine=engine)
