"""Presenting a benchmark: terminal table, JSON, CSV and plots.

With replicates (:mod:`cbcore.bench.replicates`) a cell reads ``mean ± half-width``
of its 95 % interval, the table says how the replicates were drawn and which
pairs of rows differ beyond their intervals, and the plots draw bands.
"""

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
    ("failed", "failed", 1, "{:d}"),
    ("SLO", "slo_attainment", 100, "{:.0f}%"),
    ("deadline", "deadline_attainment", 100, "{:.0f}%"),
    ("late p99", "lateness_p99_s", 1000, "{:.0f}"),
    ("preempt", "preemptions", 1, "{:d}"),
    ("recomp", "recomputed_tokens", 1, "{:d}"),
    ("KV max", "kv_util_max", 100, "{:.1f}%"),
    ("prefix hit", "prefix_cache_hit_rate", 100, "{:.1f}%"),
    ("overhead", "engine_overhead_share", 100, "{:.1f}%"),
    ("fair", "fairness_spread", 1, "{:.2f}"),
    ("svc gap", "service_gap_backlogged", 1, "{:.0f}"),
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
    text = _number(value, scale, fmt)
    half = (row.get("ci95") or {}).get(key)
    if not half:  # one run, or the same value in every replicate
        return text
    if text.endswith("%"):
        return f"{text[:-1]} ± {_number(half, scale, fmt)}"
    return f"{text} ± {_number(half, scale, fmt)}"


def _number(value: float, scale: float, fmt: str) -> str:
    if fmt == "{:d}" and not float(value).is_integer():  # a mean over replicates of a count
        fmt = "{:.1f}"
    return fmt.format(int(value) if fmt == "{:d}" else value * scale)


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
    ]
    if "replicates" in w:
        lines.append(f"{w['replicates']['method']}; cells: mean ± half-width of the 95 % interval")
    lines += [fmt_line(header), fmt_line(["-" * n for n in widths]), *(fmt_line(b) for b in body)]
    lines.extend(f"{r['name']}: FAILED: {r['error']}" for r in result.rows if "error" in r)
    lines.extend(failure_lines(ok))
    lines.extend(saturation_lines(ok))
    lines.extend(difference_lines(result))
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


def failure_lines(rows: Seq[dict[str, Any]]) -> list[str]:
    """One line per row and reason for the requests that did not complete, with a full message and ids."""
    lines = []
    for row in rows:
        for f in row.get("failures") or ():
            ids = ", ".join(f["requests"]) + (", ..." if f["count"] > len(f["requests"]) else "")
            lines.append(f"{row['name']}: {f['count']} request(s) did not complete: {f['example']} [{ids}]")
    return lines


def saturation_lines(rows: Seq[dict[str, Any]]) -> list[str]:
    """Rows whose engine fell behind the arrivals, with the evidence (:mod:`cbcore.bench.saturation`)."""
    lines = []
    for row in rows:
        if row.get("keeps_up") is False:
            of = f" ({row['keeps_up_replicates']} of {row['replicates']} replicates kept up)" if "replicates" in row else ""
            lines.append(
                f"{row['name']}: did not keep up with the arrivals ({_rate(row)}){of}: "
                f"{row['unfinished_share']:.0%} of the requests were unfinished {row['service_p90_s']:.3g} s "
                "(a p90 service time) after the last arrival; past capacity, latencies measure the run's length"
            )
    return lines


def _rate(row: dict[str, Any]) -> str:
    rate = row.get("drawn_request_rate")
    return "no rate" if rate is None else f"arrivals drawn at {rate:.3g} req/s"


#: Metric -> (label, scale, unit) for the lines on differences between rows.
DIFF_LABELS = {key: (header, scale, "ms" if scale == 1000 else "") for header, key, scale, _ in COLUMNS} | {
    "queue_p50_s": ("queue p50", 1000, "ms"),
    "recomputed_tokens": ("recomputed tokens", 1, ""),
}


def difference_lines(result: BenchResult) -> list[str]:
    """With replicates: which pairs of rows differ beyond their intervals, metric by metric."""
    info = result.workload.get("replicates")
    if not info:
        return []
    found = info["differences"]
    by_pair: dict[tuple[str, str], list[str]] = {}
    for d in found["differ"]:
        label, scale, unit = DIFF_LABELS.get(d["metric"], (d["metric"], 1, ""))
        if d["metric"] in ("slo_attainment", "deadline_attainment"):
            scale, unit = 100, " pts"
        sign = "+" if d["mean"] > 0 else "-"
        by_pair.setdefault((d["a"], d["b"]), []).append(
            f"{label} {sign}{_sig(abs(d['mean']) * scale)} ± {_sig(d['half_width'] * scale)}{unit}"
        )
    lines = [
        f"differences beyond the 95 % intervals (paired over {info['n']} replicates; A - B): "
        f"{len(by_pair)} of {found['pairs']} pairs of rows differ in some metric"
    ]
    lines.extend(f"  {a} vs {b}: {'; '.join(items)}" for (a, b), items in by_pair.items())
    return lines


def _sig(value: float) -> str:
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"


def ratios(rows: Seq[dict[str, Any]]) -> dict[str, float]:
    """Output tokens/s of the best cbcore row over each baseline's."""
    rows = [r for r in rows if "error" not in r and "output_tokens_per_s" in r]  # capacity rows have none
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
        (r for r in rows if r["kind"] == "cbcore" and "error" not in r and "output_tokens_per_s" in r),
        key=lambda r: r["output_tokens_per_s"],
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


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend, or a clear error naming the extra to install."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'cbcore[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(result: BenchResult, path: str | Path, command: str = "cb bench") -> None:
    """Latency CDFs (TTFT, TPOT, ITL, e2e, queue) and output tokens/s, one colour per row; titled ``command``."""
    plt = pyplot()
    panels = (
        ("ttft", "TTFT"),
        ("tpot", "TPOT"),
        ("itl", "ITL"),
        ("e2e", "end-to-end latency"),
        ("queue", "queue time"),
    )
    ok = [r for r in result.rows if "error" not in r]
    with_classes = any(r.get("classes") for r in ok)
    served = [r for r in ok if r.get("service_curves")][:3]
    n_rows = 2 + with_classes + bool(served)
    fig, axes = plt.subplots(n_rows, 3, figsize=(15, 4.2 * n_rows + 0.1))
    color = {r["name"]: f"C{i % 10}" for i, r in enumerate(result.rows)}
    for ax, (key, title) in zip(axes.flat, panels, strict=False):
        seen: list[float] = []
        for name, samples in result.samples.items():
            values, ys = cdf_points(samples.get(key, []))
            if values:
                seen.extend((values[0], values[-1]))
                ax.step([values[0], *values], ys, where="post", label=name, color=color[name])
                _cdf_band(ax, result.replicate_samples.get(name, []), key, color[name])
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
    errors = [(r.get("ci95") or {}).get("output_tokens_per_s") or 0.0 for r in ok]
    bar.barh(names, values, color=[color[n] for n in names], xerr=errors if any(errors) else None)
    bar.invert_yaxis()
    bar.set_title("output tokens/s")
    bar.set_xlabel("tokens/s")
    bar.grid(alpha=0.3, axis="x")
    if with_classes:
        for ax, (key, title, scale) in zip(
            axes.flat[6:9],
            (("ttft_p50_s", "TTFT p50 (ms)", 1000), ("tpot_p50_s", "TPOT p50 (ms)", 1000),
             ("deadline_attainment", "deadline attainment (%)", 100)),
            strict=True,
        ):
            _class_bars(ax, ok, key, scale, color)
            ax.set_title(f"per class: {title}")
    if served:
        base = 6 + 3 * with_classes
        for ax, row in zip(axes.flat[base:], served, strict=False):
            _service_panel(ax, row, bool(result.workload.get("replicates")))
        for ax in axes.flat[base + len(served) :]:
            ax.axis("off")
    reps = result.workload.get("replicates")
    extra = f",\n{reps['n']} replicates; bands and bars: 95 % intervals" if reps else ""
    fig.suptitle(f"{command}: {result.workload['name']} ({result.workload['num_requests']} requests{extra})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _service_panel(ax: Any, row: dict[str, Any], replicated: bool) -> None:
    """Each client's accumulated weighted service over the run (the first replicate's, with replicates)."""
    curves = row["service_curves"]
    for client, values in curves["clients"].items():
        ax.plot(curves["t_s"], values, label=client)
    w = curves["weights"]
    gap = row.get("service_gap_backlogged")
    if replicated and gap is not None:  # the curves are one replicate's: show that replicate's own gap
        gap = row["replicate_values"]["service_gap_backlogged"][0]
    ax.set_title(f"{row['name']}: service per client" + (" (replicate 0)" if replicated else ""), fontsize=10)
    ax.set_xlabel("s from the first arrival")
    ax.set_ylabel(f"input x {w['input']:g} + output x {w['output']:g} tokens")
    if gap is not None:
        ax.text(0.02, 0.95, f"largest gap while both backlogged: {gap:,.0f}", transform=ax.transAxes, va="top", fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")


def _cdf_band(ax: Any, replicates: Seq[dict[str, list[float]]], key: str, color: str) -> None:
    """The 95 % interval, across replicates, of each quantile of a CDF (a horizontal band around the line)."""
    from cbcore.bench.metrics import percentile
    from cbcore.bench.stats import mean_interval

    per = [sorted(v * 1000 for v in r.get(key, [])) for r in replicates]
    per = [p for p in per if p]
    if len(per) < 2:
        return
    qs = [i / 50 for i in range(1, 50)]
    floor, ceiling = min(p[0] for p in per), max(p[-1] for p in per)  # the band stays within what was seen
    bounds = []
    for q in qs:
        iv = mean_interval([percentile(p, 100 * q) for p in per])  # type: ignore[misc]
        half = iv.half_width or 0.0
        bounds.append((max(iv.mean - half, floor), min(iv.mean + half, ceiling)))
    ax.fill_betweenx(qs, [b[0] for b in bounds], [b[1] for b in bounds], color=color, alpha=0.15, lw=0)


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
        values, errors = [], []
        for label in labels:
            dim, _, cls = label.partition("=")
            stats = (row.get("classes") or {}).get(dim, {}).get(cls, {})
            value, half = stats.get(key), (stats.get("ci95") or {}).get(key)
            values.append(0.0 if value is None else value * scale)
            errors.append(0.0 if half is None else half * scale)
        ax.bar([j + i * width for j in range(len(labels))], values, width, label=row["name"], color=color[row["name"]],
               yerr=errors if any(errors) else None)  # fmt: skip
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))], labels, rotation=30, ha="right", fontsize=8)
    ax.grid(alpha=0.3, axis="y")
