"""From per-request timelines and per-step stats to one row of numbers.

Definitions follow vLLM's serving benchmark so that figures mean what readers
expect: duration runs from the start of the run to the last completion;
throughputs divide by it; TTFT is arrival to first token; TPOT is
``(e2e - TTFT) / (output_len - 1)`` per request with at least two tokens; ITL
pools every gap between consecutive tokens of every request; percentiles
interpolate linearly (numpy's default). Goodput counts the completed requests
that met every SLO given, per second of duration.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from itertools import chain
from statistics import fmean
from typing import Any

import numpy as np

from cbcore.bench.service import backlogged_gap, service_curves
from cbcore.bench.workload import BenchRequest
from cbcore.outputs import RequestMetrics, RequestOutput, StepStats

#: Steps with at least this many sequences count for ``engine_overhead_share_8plus``.
BUSY_SEQS = 8
SLO_KEYS = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class SLO:
    """Latency objectives in seconds (given in milliseconds on the command line)."""

    ttft: float | None = None
    tpot: float | None = None
    e2el: float | None = None

    @classmethod
    def parse(cls, text: str) -> SLO:
        """``ttft:500,tpot:50`` (milliseconds) -> SLO in seconds."""
        values: dict[str, float] = {}
        for item in filter(None, (p.strip() for p in text.split(","))):
            key, sep, raw = item.partition(":")
            key = key.strip()
            if not sep or key not in SLO_KEYS:
                raise ValueError(f"--slo {text!r}: expected KEY:MS with KEY one of {', '.join(SLO_KEYS)}")
            try:
                ms = float(raw)
            except ValueError:
                raise ValueError(f"--slo {text!r}: {key}: {raw!r} is not a number of milliseconds") from None
            if not ms > 0 or math.isinf(ms):
                raise ValueError(f"--slo {text!r}: {key} must be a positive number of milliseconds")
            values[key] = ms / 1000.0
        if not values:
            raise ValueError(f"--slo {text!r}: give at least one of {', '.join(SLO_KEYS)}")
        return cls(**values)

    def met(self, m: RequestMetrics) -> bool:
        # As vLLM does, a one-token output has a TPOT of 0 for this check.
        checks = ((self.ttft, m.ttft), (self.tpot, m.tpot or 0.0), (self.e2el, m.e2e))
        return all(limit is None or (value is not None and value <= limit) for limit, value in checks)

    def as_ms(self) -> dict[str, float]:
        return {k: getattr(self, k) * 1000 for k in SLO_KEYS if getattr(self, k) is not None}


def percentile(values: Seq[float] | np.ndarray, q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default method)."""
    if len(values) == 0:
        return None
    if isinstance(values, np.ndarray):
        return float(np.percentile(values, q))
    data = sorted(values)
    pos = (len(data) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def distribution(prefix: str, values: Seq[float] | np.ndarray) -> dict[str, float | None]:
    """Mean and percentiles; an array (a trace's millions of ITL gaps) is summarised in numpy, in one sort."""
    if isinstance(values, np.ndarray):
        if values.size == 0:
            return dict.fromkeys((f"{prefix}_{k}_s" for k in ("mean", "p50", "p90", "p99")), None)
        p50, p90, p99 = np.percentile(values, (50, 90, 99)).tolist()
        return {f"{prefix}_mean_s": float(values.mean()), f"{prefix}_p50_s": p50, f"{prefix}_p90_s": p90,
                f"{prefix}_p99_s": p99}  # fmt: skip
    return {
        f"{prefix}_mean_s": fmean(values) if values else None,
        f"{prefix}_p50_s": percentile(values, 50),
        f"{prefix}_p90_s": percentile(values, 90),
        f"{prefix}_p99_s": percentile(values, 99),
    }


def completed(out: RequestOutput) -> bool:
    return out.finished and out.finish_reason in ("stop", "length") and out.metrics is not None


def failure_reasons(outputs: Seq[RequestOutput]) -> list[dict[str, Any]]:
    """The requests that did not complete, grouped by reason: count, a few request ids, one full message.

    A reason is the error text with the request's own id and every number
    taken out, so that "the prompt's 900 tokens + max_new_tokens 300 needs KV
    for 1199 tokens ..." and the same refusal of another request count together.
    """
    groups: dict[str, dict[str, Any]] = {}
    for out in outputs:
        if completed(out):
            continue
        if out.error:
            text = out.error
        elif out.finished:
            text = f"finished with reason {out.finish_reason!r}"
        else:
            text = "did not finish"
        reason = re.sub(r"\d+(\.\d+)?", "N", text.replace(f"request {out.request_id}: ", ""))
        group = groups.setdefault(reason, {"reason": reason, "count": 0, "requests": [], "example": text})
        group["count"] += 1
        if len(group["requests"]) < 10:
            group["requests"].append(out.request_id)
    return sorted(groups.values(), key=lambda g: -g["count"])


def recomputed_tokens(outputs: Seq[RequestOutput], steps: Seq[StepStats]) -> int | None:
    """Tokens prefilled again after a recompute preemption: every prefill token the steps computed, less
    each request's first prefill (its prompt less the prefix-cache hits of a request never preempted).

    A preempted request's first prefill is taken as its whole prompt, so the count
    is exact when preempted requests found no cached prefix on their first
    admission (prompts that share nothing) and otherwise low by those hits.
    None without step records (baselines, servers).
    """
    if not steps:
        return None
    first = 0
    for out in outputs:
        m = out.metrics
        if m is None:
            continue
        first += m.prompt_len if m.num_preemptions else m.prompt_len - m.prefix_cache_hits
    return max(0, sum(s.num_prefill_tokens for s in steps) - first)


def latency_samples(outputs: Seq[RequestOutput]) -> dict[str, Any]:
    """Every request's TTFT, TPOT, e2e and queue time, normalised latency (e2e per output token, the
    latency a reader of a stream perceives: Orca's and vLLM's "normalized latency") as lists, and every
    ITL gap (completed requests only).

    The ITL gaps are a float64 array: a trace hour has millions of them, which
    as Python floats would take ~32 bytes each instead of 8.
    """
    done = [o.metrics for o in outputs if completed(o)]
    return {
        "ttft": [m.ttft for m in done if m.ttft is not None],
        "tpot": [m.tpot for m in done if m.tpot is not None],
        "itl": itl_gaps(done),
        "e2e": [m.e2e for m in done if m.e2e is not None],
        "queue": [m.queue_time for m in done if m.queue_time is not None],
        "norm_latency": [m.e2e / m.output_len for m in done if m.e2e is not None and m.output_len > 0],
    }


def itl_gaps(metrics: Seq[RequestMetrics]) -> np.ndarray:
    """The gaps between consecutive tokens of each request, all requests pooled, in request order."""
    counts = np.fromiter((len(m.token_times) for m in metrics), np.int64, count=len(metrics))
    times = np.fromiter(chain.from_iterable(m.token_times for m in metrics), np.float64, count=int(counts.sum()))
    if times.size < 2:
        return np.empty(0)
    gaps = times[:-1]
    np.subtract(times[1:], gaps, out=gaps)  # in place: a trace hour's gaps are tens of MB
    ends = np.cumsum(counts)[:-1] - 1  # the gap from a request's last token to the next request's first
    return np.delete(gaps, ends[(ends >= 0) & (ends < gaps.size)])


def client_service(requests: Seq[BenchRequest], outputs: Seq[RequestOutput]) -> dict[str, dict[str, Any]]:
    """Per client: tokens served, and time with at least one request in the system.

    ``tokens_per_backlogged_s`` is the rate at which a client was served while
    it was waiting for something; equal rates mean no client got a smaller
    share of the server while it had work.
    """
    spans: dict[str, list[tuple[float, float]]] = {}
    served: dict[str, int] = {}
    count: dict[str, int] = {}
    for req, out in zip(requests, outputs, strict=True):
        c = req.client_id
        count[c] = count.get(c, 0) + 1
        m = out.metrics
        if m is None or m.finish_time is None:
            continue
        served[c] = served.get(c, 0) + m.prompt_len + m.output_len
        spans.setdefault(c, []).append((m.arrival_time, m.finish_time))
    result = {}
    for c in sorted(count):
        backlogged = _union_length(spans.get(c, []))
        tokens = served.get(c, 0)
        result[c] = {
            "requests": count[c],
            "served_tokens": tokens,
            "backlogged_s": backlogged,
            "tokens_per_backlogged_s": tokens / backlogged if backlogged > 0 else None,
        }
    return result


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def fairness_spread(clients: dict[str, dict[str, Any]]) -> float | None:
    """max / min of the clients' served tokens per backlogged second; 1.0 is perfectly even."""
    rates = [c["tokens_per_backlogged_s"] for c in clients.values() if c["tokens_per_backlogged_s"]]
    if len(rates) < 2:
        return None
    return max(rates) / min(rates)


def step_summary(steps: Seq[StepStats], busy_s: float | None) -> dict[str, Any]:
    """Where the time went, how full the batches and the KV cache were."""
    if not steps:
        return {"steps": 0}
    total = sum(s.total_s for s in steps)
    forward = sum(s.forward_s for s in steps)
    busy = [s for s in steps if s.num_seqs >= BUSY_SEQS]
    busy_total = sum(s.total_s for s in busy)
    kv = [s.kv_blocks_used / s.kv_blocks_total for s in steps if s.kv_blocks_total]
    denom = busy_s if busy_s is not None and busy_s > 0 else total
    return {
        "steps": len(steps),
        "mean_tokens_per_step": fmean(s.num_tokens for s in steps),
        "mean_seqs_per_step": fmean(s.num_seqs for s in steps),
        "max_seqs_per_step": max(s.num_seqs for s in steps),
        "mixed_steps": sum(s.is_mixed for s in steps),
        "prefill_tokens": sum(s.num_prefill_tokens for s in steps),
        "decode_tokens": sum(s.num_decode_tokens for s in steps),
        "kv_util_mean": fmean(kv) if kv else None,
        "kv_util_max": max(kv) if kv else None,
        "forward_s": forward,
        "schedule_ms_per_step": 1000 * fmean(s.schedule_s for s in steps),
        "prepare_ms_per_step": 1000 * fmean(s.prepare_s for s in steps),
        "sample_ms_per_step": 1000 * fmean(s.sample_s for s in steps),
        "forward_ms_per_step": 1000 * forward / len(steps),
        # Everything but the model forward, as a share of the time the engine was busy.
        "engine_overhead_share": max(0.0, 1.0 - forward / denom) if denom > 0 else None,
        f"engine_overhead_share_{BUSY_SEQS}plus": (
            1.0 - sum(s.forward_s for s in busy) / busy_total if busy_total > 0 else None
        ),
        f"steps_{BUSY_SEQS}plus": len(busy),
    }


def summarize(
    name: str,
    requests: Seq[BenchRequest],
    outputs: Seq[RequestOutput],
    duration_s: float,
    *,
    steps: Seq[StepStats] = (),
    busy_s: float | None = None,
    slo: SLO | None = None,
) -> dict[str, Any]:
    """One row: throughput, latency distributions, goodput, preemptions, fairness, step stats."""
    if len(requests) != len(outputs):
        raise ValueError(f"{len(outputs)} outputs for {len(requests)} requests")
    if duration_s <= 0:
        raise ValueError(f"duration must be positive, got {duration_s}")
    done = [o for o in outputs if completed(o)]
    out_tokens = sum(len(o.output_token_ids) for o in done)
    in_tokens = sum(len(o.prompt_token_ids) for o in done)
    samples = latency_samples(outputs)
    row: dict[str, Any] = {
        "name": name,
        "num_requests": len(outputs),
        "completed": len(done),
        "failed": len(outputs) - len(done),
        "duration_s": duration_s,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / duration_s,
        "total_tokens_per_s": (in_tokens + out_tokens) / duration_s,
        "request_throughput": len(done) / duration_s,
    }
    for key in ("ttft", "tpot", "itl", "e2e", "queue", "norm_latency"):
        row.update(distribution(key, samples[key]))
    if slo is not None:
        good = sum(slo.met(o.metrics) for o in done)
        row.update(goodput=good / duration_s, slo_attainment=good / len(outputs), slo_ms=slo.as_ms())
    # Every eviction counts, also of a request that failed later.
    row["preemptions"] = sum(o.metrics.num_preemptions for o in outputs if o.metrics is not None)
    row["failures"] = failure_reasons(outputs)
    recomputed = recomputed_tokens(outputs, steps)
    computed = sum(s.num_tokens for s in steps)
    row.update(
        recomputed_tokens=recomputed,
        recompute_share=recomputed / computed if recomputed is not None and computed else None,
    )
    # Prefix cache, in tokens: what admissions looked up and found (None where nothing was looked up,
    # e.g. with caching off or for a baseline).
    queries = sum(o.metrics.prefix_cache_queries for o in done)
    hits = sum(o.metrics.prefix_cache_hits for o in done)
    row.update(
        prefix_cache_queries_tokens=queries,
        prefix_cache_hits_tokens=hits,
        prefix_cache_hit_rate=hits / queries if queries else None,
    )
    clients = client_service(requests, outputs)
    row.update(fairness_spread=fairness_spread(clients), clients=clients)
    if len(clients) > 1:
        row.update(service_gap_backlogged=backlogged_gap(requests, outputs), service_curves=service_curves(requests, outputs))
    row.update(step_summary(steps, busy_s))
    row.setdefault("engine_overhead_share", None)
    return row
