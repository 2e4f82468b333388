"""Presenting a benchmark: terminal table, JSON, CSV and plots."""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

import numpy as np

from cbcore.bench.classes import class_lines
from cbcore.bench.suite import BenchResult
from cbcore.bench.traces import describe_rule

# (header, row key, scale, format): latencies are shown in milliseconds.
COLUMNS: tuple[tuple[str, str, float, str], ...] = (
    ("out tok/s", "output_tokens_per_s", 1, "{:.1f}"),
    ("req/s", "request_throughput", 1, "{:.3f}"),
    ("TTFT p50", "ttft_p50_s", 1000, "{:.0f}"),
    ("TTFT p99", "ttft_p99_s", 1000, "{:.0f}"),
    ("TPOT p50", "tpot_p50_s", 1000, "{:.1f}"),
    ("TPOT p99", "tpot_p99_s", 1000, "{:.1f}"),
    ("ITL p50", "itl_p50_s", 1000, "{:.1f}"),
    ("ITL p99", "itl_p99_s", 1000, "{:.1f}"),
    ("e2e p50", "e2e_p50_s", 1000, "{:.0f}"),
    ("e2e p99", "e2e_p99_s", 1000, "{:.0f}"),
    ("goodput", "goodput", 1, "{:.3f}"),
    ("SLO", "slo_attainment", 100, "{:.0f}%"),
    ("deadline", "deadline_attainment", 100, "{:.0f}%"),
    ("preempt", "preemptions", 1, "{:d}"),
    ("KV max", "kv_util_max", 100, "{:.1f}%"),
    ("prefix hit", "prefix_cache_hit_rate", 100, "{:.1f}%"),
    ("overhead", "engine_overhead_share", 100, "{:.1f}%"),
    ("fair", "fairness_spread", 1, "{:.2f}"),
    ("RSS MB", "rss_peak_mb", 1, "{:.0f}"),
    ("KV MB", "kv_pool_mb", 1, "{:.0f}"),
    ("=ref", "identical_to_reference", 1, "{}"),
)


def _cell(row: dict[str, Any], key: str, scale: float, fmt: str) -> str:
    value = row.get(key)
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    return fmt.format(value * scale if scale != 1 else value)


def table(result: BenchResult) -> str:
    """A plain aligned table (latencies in ms), then the throughput ratios."""
    cols = [c for c in COLUMNS if any(r.get(c[1]) is not None for r in result.rows)]
    header = ["config", *[c[0] for c in cols]]
    ok = [r for r in result.rows if "error" not in r]
    body = [[r["name"], *[_cell(r, key, scale, fmt) for _, key, scale, fmt in cols]] for r in ok]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]

    def fmt_line(cells: Seq[str]) -> str:
        first = cells[0].ljust(widths[0])
        return "  ".join([first, *(c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True))])

    w = result.workload
    over = "per value, over up to" if "sweep" in w else "over"
    lines = [
        f"workload {w['name']}: {w['num_requests']} requests {over} {w['arrival_span_s']:.1f} s "
        "(latencies in ms; overhead = share of busy time outside the model forward)",
        *([describe_rule(w["trace"])] if w.get("trace") else []),
        fmt_line(header),
        fmt_line(["-" * n for n in widths]),
        *(fmt_line(b) for b in body),
    ]
    lines.extend(f"{r['name']}: FAILED: {r['error']}" for r in result.rows if "error" in r)
    lines.extend(
        f"{r['name']}: the server kept its prefix cache between runs ({r['prefix_cache_kept']})"
        for r in ok
        if r.get("prefix_cache_kept")
    )
    lines.extend(ratio_lines(result.rows))
    peak = w.get("process_peak_rss_mb")
    if peak is not None:
        lines.append(f"process peak RSS {peak:.0f} MB (RSS MB: each row's own peak, sampled while it ran)")
    lines.extend(class_lines(ok))
    return "\n".join(lines)


def ratios(rows: Seq[dict[str, Any]]) -> dict[str, float]:
    """Output tokens/s of the best cbcore row over each baseline's."""
    rows = [r for r in rows if "error" not in r]
    ours = [r for r in rows if r["kind"] == "cbcore"]
    if not ours:
        return {}
    best = max(ours, key=lambda r: r["output_tokens_per_s"])
    return {
        r["name"]: best["output_tokens_per_s"] / r["output_tokens_per_s"]
        for r in rows
        if r["kind"] == "baseline" and r["output_tokens_per_s"] > 0
    }


def ratio_lines(rows: Seq[dict[str, Any]]) -> list[str]:
    found = ratios(rows)
    if not found:
        return []
    best = max(
        (r for r in rows if r["kind"] == "cbcore" and "error" not in r), key=lambda r: r["output_tokens_per_s"]
    )
    return [f"{best['name']} vs {name}: {x:.2f}x output tokens/s" for name, x in found.items()]


def to_json(result: BenchResult) -> dict[str, Any]:
    data = result.to_json()
    data["speedups"] = ratios(result.rows)
    return data


def write_json(result: BenchResult, path: str | Path) -> None:
    Path(path).write_text(json.dumps(to_json(result), indent=2) + "\n")


def write_csv(result: BenchResult, path: str | Path) -> None:
    """One line per row; nested values (per-client stats, SLOs) as JSON text."""
    keys: list[str] = []
    for row in result.rows:
        keys.extend(k for k in row if k not in keys)
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=keys)
        writer.writeheader()
        for row in result.rows:
            writer.writerow({k: json.dumps(v) if isinstance(v, dict | list) else v for k, v in row.items()})


def plot(result: BenchResult, path: str | Path, command: str = "cb bench") -> None:
    """Latency CDFs (TTFT, TPOT, ITL, e2e, queue) and output tokens/s, one colour per row; titled ``command``."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'cbcore[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (
        ("ttft", "TTFT"),
        ("tpot", "TPOT"),
        ("itl", "ITL"),
        ("e2e", "end-to-end latency"),
        ("queue", "queue time"),
    )
    ok = [r for r in result.rows if "error" not in r]
    with_classes = any(r.get("classes") for r in ok)
    fig, axes = plt.subplots(3 if with_classes else 2, 3, figsize=(15, 12.5 if with_classes else 8.5))
    color = {r["name"]: f"C{i % 10}" for i, r in enumerate(result.rows)}
    for ax, (key, title) in zip(axes.flat, panels, strict=False):
        seen: list[float] = []
        for name, samples in result.samples.items():
            values, ys = cdf_points(samples.get(key, []))
            if values:
                seen.extend((values[0], values[-1]))
                ax.step([values[0], *values], ys, where="post", label=name, color=color[name])
        ax.set_title(f"{title} CDF")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of samples")
        if seen and min(seen) > 0 and max(seen) / min(seen) > 30:  # long tails: log scale
            ax.set_xscale("log")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    bar = axes.flat[5]
    names = [r["name"] for r in ok]
    values = [r["output_tokens_per_s"] for r in ok]
    bar.barh(names, values, color=[color[n] for n in names])
    bar.invert_yaxis()
    bar.set_title("output tokens/s")
    bar.set_xlabel("tokens/s")
    bar.grid(alpha=0.3, axis="x")
    if with_classes:
        for ax, (key, title, scale) in zip(
            axes.flat[6:],
            (("ttft_p50_s", "TTFT p50 (ms)", 1000), ("tpot_p50_s", "TPOT p50 (ms)", 1000),
             ("deadline_attainment", "deadline attainment (%)", 100)),
            strict=True,
        ):
            _class_bars(ax, ok, key, scale, color)
            ax.set_title(f"per class: {title}")
    fig.suptitle(f"{command}: {result.workload['name']} ({result.workload['num_requests']} requests)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cdf_points(samples: Any, most: int = 4000) -> tuple[list[float], list[float]]:
    """An empirical CDF in milliseconds: sorted values and the fractions at and after them.

    Beyond ``most`` samples (a trace hour's millions of ITL gaps) it keeps
    ``most`` evenly spaced order statistics, the first and last included: the
    drawn curve is the same to the width of a line.
    """
    values = np.sort(np.asarray(samples, dtype=np.float64)) * 1000
    n = values.size
    if n == 0:
        return [], []
    if n <= most:
        return values.tolist(), [i / n for i in range(n + 1)]
    ranks = np.unique(np.linspace(0, n - 1, most).round().astype(np.int64))
    return values[ranks].tolist(), [0.0, *((ranks + 1) / n).tolist()]


def _class_bars(ax: Any, rows: Seq[dict[str, Any]], key: str, scale: float, color: dict[str, str]) -> None:
    """Grouped bars: one group per class (``dimension=label``), one bar per row."""
    labels = sorted({f"{d}={c}" for r in rows for d, cs in (r.get("classes") or {}).items() for c in cs})
    width = 0.8 / max(1, len(rows))
    for i, row in enumerate(rows):
        values = []
        for label in labels:
            dim, _, cls = label.partition("=")
            value = (row.get("classes") or {}).get(dim, {}).get(cls, {}).get(key)
            values.append(0.0 if value is None else value * scale)
        ax.bar([j + i * width for j in range(len(labels))], values, width, label=row["name"], color=color[row["name"]])
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))], labels, rotation=30, ha="right", fontsize=8)
    ax.grid(alpha=0.3, axis="y")
