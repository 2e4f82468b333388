"""Turning one step's logits into one token per sampling sequence.

Greedy rows are decided together by one max over the vocabulary. Sampled rows are decided one
by one, each with its own ``torch.Generator``: a request's random stream is
consumed only by that request, so its tokens do not depend on what else was
batched with it (or on how often it was preempted).
"""

from __future__ import annotations

import torch

from cbcore.scheduling.plan import RowPlan


def sample(logits: torch.Tensor, rows: list[RowPlan]) -> tuple[list[int], list[dict[int, float] | None]]:
    """``logits[i]`` belongs to ``rows[i]`` (a sampling row); returns tokens and optional top log-probs."""
    logits = logits.float()
    # max's indices are argmax's (the first of tied maxima), 2.8x faster here: [64, 49152] in 0.8 ms
    tokens = logits.max(dim=-1).indices.tolist()
    top: list[dict[int, float] | None] = [None] * len(rows)
    logprobs = torch.log_softmax(logits, dim=-1) if any(r.params.logprobs is not None for r in rows) else None
    for i, row in enumerate(rows):
        params = row.params
        if not params.greedy:
            tokens[i] = _sample_row(logits[i], params.temperature, params.top_k, params.top_p, row.generator)
        if logprobs is not None and params.logprobs is not None:
            lp = logprobs[i]
            values, ids = lp.topk(params.logprobs) if params.logprobs else (lp[:0], lp[:0].long())
            top[i] = dict(zip(ids.tolist(), values.tolist(), strict=True)) | {tokens[i]: float(lp[tokens[i]])}
    return tokens, top


def _sample_row(
    row: torch.Tensor, temperature: float, top_k: int, top_p: float, generator: torch.Generator | None
) -> int:
    row = row / temperature
    if top_k and top_k < row.shape[-1]:
        row = row.masked_fill(row < torch.topk(row, top_k).values[-1], float("-inf"))  # below the k-th best
    if top_p < 1.0:
        sorted_logits, order = torch.sort(row, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass before it already reaches top_p (keeps at least one).
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
        row = row.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if generator is not None and probs.device.type != "cpu":
        # Generators are CPU-side so a request's stream is device-independent.
        probs = probs.cpu()
    return int(torch.multinomial(probs, 1, generator=generator).item())


def sample_each(
    logits: torch.Tensor, rows: list[RowPlan], rng_states: list[tuple[torch.Generator, torch.Tensor]]
) -> tuple[list[int], list[dict[int, float] | None], list[str | None]]:
    """:func:`sample`, except that a row whose sampling fails fails alone: its error is returned.

    The batch is sampled at once; only when that raises is each row sampled on
    its own, after putting back the generators' states (``rng_states``, taken
    before the call), so each request's draws are the ones it would get alone.
    """
    try:
        return (*sample(logits, rows), [None] * len(rows))
    except Exception:
        for generator, state in rng_states:
            generator.set_state(state)
    tokens, top, errors = [-1] * len(rows), [None] * len(rows), [None] * len(rows)
    for i, row in enumerate(rows):
        try:
            (tokens[i],), (top[i],) = sample(logits[i : i + 1], [row])
        except Exception as exc:
            errors[i] = f"sampling failed: {type(exc).__name__}: {exc}"
    return tokens, top, errors
