"""The seeds' continuous-batching toy as an outside baseline (``--baseline seed-toy``).

The seeds explain continuous batching with a small program; this row runs the
same approach on the benchmark's model and requests, so that cbcore can be
compared with the idea in its simplest working form:

* up to ``batch_size`` sequences hold a slot; a finished one frees its slot
  and the next arrived request takes it in the same step;
* every step packs all slots' pending tokens (a whole prompt for a new
  sequence, one token for a decoding one) into one row ``[1, total_q]`` with
  per-sequence position ids, and one eager forward runs it;
* isolation comes from a 4D additive mask ``[1, 1, total_q, total_kv +
  total_q]``: a query sees keys of its own sequence at positions up to its
  own (block-diagonal, causal);
* each sequence keeps its own KV tensors; every step concatenates all of
  them along time into one cache for the forward, and afterwards slices this
  step's new keys/values out and appends them to each sequence's own tensors
  (two concatenations per layer per sequence per step);
* greedy: the next token is the argmax of the logits at each sequence's last
  pending position (logits are computed for every packed position).

Arrivals, token timestamps and the token cut follow the other baselines.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from cbcore.bench.arrivals import Arrivals
from cbcore.bench.baselines import baseline_output, cut
from cbcore.bench.driver import ProgressFactory, RunResult, no_progress
from cbcore.bench.workload import Workload
from cbcore.models.loading import eos_token_ids
from cbcore.outputs import RequestOutput


@dataclass
class _Slot:
    index: int  # the request's position in the workload
    pending: list[int]  # tokens to feed next step: the prompt, then one token at a time
    cap: int
    started: float
    kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer [1, Hkv, L, D]
    kv_len: int = 0
    tokens: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)


def _block_diagonal_mask(slots: Seq[_Slot], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive ``[1, 1, total_q, total_kv + total_q]``: keys are [every cached KV | this step's]."""
    key_seq: list[int] = []
    key_pos: list[int] = []
    for i, s in enumerate(slots):
        key_seq += [i] * s.kv_len
        key_pos += list(range(s.kv_len))
    q_seq: list[int] = []
    q_pos: list[int] = []
    for i, s in enumerate(slots):
        q_seq += [i] * len(s.pending)
        q_pos += list(range(s.kv_len, s.kv_len + len(s.pending)))
    key_seq += q_seq
    key_pos += q_pos
    qs, qp = torch.tensor(q_seq), torch.tensor(q_pos)
    ks, kp = torch.tensor(key_seq), torch.tensor(key_pos)
    allowed = (qs[:, None] == ks[None, :]) & (kp[None, :] <= qp[:, None])
    mask = torch.zeros(allowed.shape, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None].to(device)


def _packed_cache(slots: Seq[_Slot], num_layers: int) -> DynamicCache:
    cache = DynamicCache()
    cached = [s for s in slots if s.kv_len]
    if cached:
        for layer in range(num_layers):
            k = torch.cat([s.kv[layer][0] for s in cached], dim=2)  # type: ignore[index]
            v = torch.cat([s.kv[layer][1] for s in cached], dim=2)  # type: ignore[index]
            cache.update(k, v, layer)
    return cache


@torch.inference_mode()
def ragged_step(model: torch.nn.Module, slots: Seq[_Slot]) -> list[int]:
    """One packed forward over every slot's pending tokens; returns each slot's greedy token."""
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    num_layers = model.config.get_text_config().num_hidden_layers
    q_lens = [len(s.pending) for s in slots]
    total_kv = sum(s.kv_len for s in slots)
    ids = torch.tensor([[t for s in slots for t in s.pending]], device=device)
    positions = torch.tensor([[s.kv_len + j for s in slots for j in range(len(s.pending))]], device=device)
    out = model(
        input_ids=ids,
        attention_mask=_block_diagonal_mask(slots, dtype, device),
        position_ids=positions,
        past_key_values=_packed_cache(slots, num_layers),
        use_cache=True,
    )
    logits = out.logits[0]
    offsets = [sum(q_lens[:i]) for i in range(len(slots))]
    tokens = [int(logits[o + q - 1].argmax()) for o, q in zip(offsets, q_lens, strict=True)]
    layers = out.past_key_values.layers
    for s, o, q in zip(slots, offsets, q_lens, strict=True):
        new = [
            (
                lay.keys[:, :, total_kv + o : total_kv + o + q],
                lay.values[:, :, total_kv + o : total_kv + o + q],
            )
            for lay in layers
        ]
        if s.kv is None:
            s.kv = new
        else:
            s.kv = [
                (torch.cat([k, nk], dim=2), torch.cat([v, nv], dim=2))
                for (k, v), (nk, nv) in zip(s.kv, new, strict=True)
            ]
        s.kv_len += q
    return tokens


def run_seed_toy(
    model: torch.nn.Module,
    workload: Workload,
    token_ids: Seq[Seq[int]],
    *,
    batch_size: int,
    progress: ProgressFactory = no_progress,
    clock: Callable[[], float] = time.perf_counter,
    sleep: Callable[[float], None] = time.sleep,
) -> RunResult:
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    requests = workload.requests
    eos = set(eos_token_ids(model))
    config = model.config
    previous = config._attn_implementation_internal
    config._attn_implementation_internal = "eager"  # the toy's attention: the 4D mask, as given
    try:
        warm = _Slot(0, list(token_ids[0][:8]), 4, clock())
        for _ in range(3):
            warm.pending = [ragged_step(model, [warm])[0]]
        outputs: dict[int, RequestOutput] = {}
        bar = progress(len(requests), "seed-toy")
        queue: list[int] = []
        slots: list[_Slot] = []
        idle = 0.0
        start = clock()
        arrivals = Arrivals(requests, start, token_ids)
        while len(outputs) < len(requests):
            queue.extend(arrivals.due(clock()))
            while queue and len(slots) < batch_size:
                i = queue.pop(0)
                slots.append(_Slot(i, list(arrivals.prompt(i)), requests[i].max_new_tokens, clock()))
            if not slots:
                idle += arrivals.wait(clock, sleep)
                continue
            tokens = ragged_step(model, slots)
            now = clock()
            still = []
            for s, tok in zip(slots, tokens, strict=True):
                s.tokens.append(tok)
                s.times.append(now)
                s.pending = [tok]
                req = requests[s.index]
                if len(s.tokens) >= s.cap or (tok in eos and not req.ignore_eos):
                    kept, reason = cut(s.tokens, req, list(eos))
                    prompt = arrivals.prompt(s.index)
                    arrival = arrivals.arrival_time(s.index)
                    out = baseline_output(req, prompt, kept, reason, arrival, s.started, s.times)
                    outputs[s.index] = out
                    arrivals.finished(s.index, out, now)
                    bar.update(1)
                else:
                    still.append(s)
            slots = still
        duration = clock() - start
        bar.close()
    finally:
        config._attn_implementation_internal = previous
    return RunResult(
        name="seed-toy",
        kind="baseline",
        outputs=[outputs[i] for i in range(len(requests))],
        duration_s=duration,
        busy_s=duration - idle,
        info={"batch_size": batch_size},
    )
