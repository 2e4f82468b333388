"""The seeds' ``#``/``.`` picture of one packed step's block-diagonal causal mask.

The picture is drawn from the very mask the backends use
(:func:`cbcore.backends.eager.block_diagonal_causal_mask`) over the step's
:class:`~cbcore.batch.FlatBatch`. Unlike the seeds' toy, which re-assembled
one ``[all cached | all new]`` key row every step, each sequence here reads
only its own keys from the paged cache, so the key axis is grouped per
sequence: its cached tokens, ``|``, then the tokens it runs this step.
"""

from __future__ import annotations

from typing import Any

from cbcore.backends.eager import block_diagonal_causal_mask
from cbcore.engine import StepRecord

MAX_TOKEN_TEXT = 64


def _token_text(tokenizer: Any, ids: list[int]) -> str:
    if tokenizer is None:
        text = " ".join(str(t) for t in ids)
    else:
        text = " ".join(repr(tokenizer.decode([t])) for t in ids)
    return text if len(text) <= MAX_TOKEN_TEXT else text[: MAX_TOKEN_TEXT - 3] + "..."


def render_step(
    record: StepRecord, labels: dict[str, str], slots: list[str | None], tokenizer: Any, title: str
) -> str:
    """The packed row and its mask, as text (row = query token, column = key)."""
    batch = record.batch
    if batch is None:
        raise ValueError("this step ran no forward: nothing to draw")
    names = [labels[item.seq.request_id] for item in record.output.scheduled]
    q_lens = batch.query_lens
    cached = [ctx - q for ctx, q in zip(batch.context_lens, q_lens, strict=True)]
    ids = batch.input_ids.tolist()
    starts = batch.cu_seqlens_q.tolist()
    lines = [
        f"STEP {record.stats.step}: {title}",
        f"{len(names)} sequences packed into one row of {batch.num_tokens} query tokens (no padding); "
        f"{sum(cached)} keys read from the KV cache",
    ]
    for i, name in enumerate(names):
        slot = slots.index(name) if name in slots else "?"
        kind = f"prefill({q_lens[i]})" if q_lens[i] > 1 else "decode(1)"
        tokens = _token_text(tokenizer, ids[starts[i] : starts[i + 1]])
        lines.append(f"  {name} = slot {slot}  {kind:<12} cached {cached[i]:>3}  {tokens}")

    allowed = block_diagonal_causal_mask(batch, None).tolist()
    cu_k = batch.cu_seqlens_k.tolist()

    def cells(row: list[Any], chars: tuple[str, str] | None = None) -> str:
        groups = []
        for i in range(len(names)):
            part = row[cu_k[i] : cu_k[i + 1]]
            text = "".join(chars[0] if c else chars[1] for c in part) if chars else "".join(part)
            groups.append(text[: cached[i]] + "|" + text[cached[i] :] if cached[i] else text)
        return " ".join(groups)

    key_row = [names[i] for i in range(len(names)) for _ in range(cu_k[i + 1] - cu_k[i])]
    positions = batch.positions.tolist()
    lines.append("")
    lines.append("  block-diagonal causal mask: # attend, . masked; keys per sequence: cached | new")
    lines.append(f"  {'keys':>7}  {cells(key_row)}")
    token_seq = [i for i, q in enumerate(q_lens) for _ in range(q)]
    for t, row in enumerate(allowed):
        lines.append(f"  {names[token_seq[t]] + ' p' + str(positions[t]):>7}  {cells(row, ('#', '.'))}")
    return "\n".join(lines)
