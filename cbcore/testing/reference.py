"""The reference side of the equivalence contract: HF ``generate()`` on each prompt alone."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch
from transformers import GenerationConfig

from cbcore.models.loading import eos_token_ids


@dataclass(frozen=True)
class ReferenceOutput:
    token_ids: list[int]
    # Per generated position, the top-k (token id -> log-prob); only when asked for.
    top_logprobs: list[dict[int, float]] | None = None


@torch.inference_mode()
def reference_generate(
    model: torch.nn.Module,
    prompts: Seq[Seq[int]],
    max_new_tokens: int | Seq[int],
    *,
    ignore_eos: bool = False,
    top_logprobs: int = 0,
) -> list[ReferenceOutput]:
    """Greedy ``generate()`` per prompt: batch of one, no padding, no other logits processors.

    A fresh ``GenerationConfig`` is used so that settings shipped with a
    checkpoint (repetition penalty, sampling defaults) cannot sneak in: the
    contract is about plain greedy decoding.
    """
    caps = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(caps) != len(prompts):
        raise ValueError(f"{len(caps)} max_new_tokens for {len(prompts)} prompts")
    device = next(model.parameters()).device
    eos = () if ignore_eos else eos_token_ids(model)
    pad = eos[0] if eos else 0
    results = []
    for prompt, cap in zip(prompts, caps, strict=True):
        ids = torch.tensor([list(prompt)], dtype=torch.long, device=device)
        config = GenerationConfig(
            max_new_tokens=cap,
            do_sample=False,
            # None would be filled in from the model's own generation config; -1 never matches.
            eos_token_id=list(eos) if eos else -1,
            pad_token_id=pad,
            output_logits=bool(top_logprobs),
            return_dict_in_generate=True,
        )
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        tokens = out.sequences[0, ids.shape[1] :].tolist()
        tops = None
        if top_logprobs:
            tops = []
            for step_logits in out.logits:
                lp = torch.log_softmax(step_logits[0].float(), dim=-1)
                values, idx = lp.topk(top_logprobs)
                tops.append(dict(zip(idx.tolist(), values.tolist(), strict=True)))
        results.append(ReferenceOutput(tokens, tops))
    return results


@torch.inference_mode()
def next_token_logits(model: torch.nn.Module, token_ids: Seq[int]) -> torch.Tensor:
    """The model's logits for the token after ``token_ids``, computed alone (float32)."""
    device = next(model.parameters()).device
    ids = torch.tensor([list(token_ids)], dtype=torch.long, device=device)
    return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, -1].float()
