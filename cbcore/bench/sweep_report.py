"""The sweep's figure: every metric against the swept value, one line per configuration.

Panels: deadline attainment (all requests with a deadline, then per priority
class), TTFT p99, TPOT p99, request throughput beside the offered rate, and
goodput. A dotted vertical line in a configuration's colour marks the first
value at which the engine stopped keeping up with the arrivals
(:mod:`cbcore.bench.saturation`): to its right the queue grows for as long as
requests arrive, and latencies measure the run's length. With replicates each
line is the mean and a band its 95 % interval.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

from cbcore.bench.classes import sort_label
from cbcore.bench.saturation import saturation_value
from cbcore.bench.suite import BenchResult
from cbcore.bench.sweep import by_config

LINE_STYLES = ("-", "--", ":", "-.")
# (title, row key, scale): the panels after the two attainment panels.
PANELS = (
    ("TTFT p99 (ms)", "ttft_p99_s", 1000.0),
    ("TPOT p99 (ms)", "tpot_p99_s", 1000.0),
    ("request throughput (req/s)", "request_throughput", 1.0),
    ("goodput (req/s meeting --slo)", "goodput", 1.0),
)


def plot_sweep(result: BenchResult, path: str | Path, command: str) -> None:
    """Write the sweep figure to ``path`` (PNG); ``command`` titles it (``cb simulate``, ``cb bench``)."""
    from cbcore.bench.report import pyplot

    plt = pyplot()
    sweep = result.workload["sweep"]
    key, values = sweep["key"], sweep["values"]
    numeric = all(isinstance(v, float) for v in values)
    position = {v: (v if numeric else i) for i, v in enumerate(values)}
    groups = by_config(result.rows)
    color = {name: f"C{i % 10}" for i, name in enumerate(groups)}
    fig, axes = plt.subplots(2, 3, figsize=(16, 9.5))
    flat = list(axes.flat)

    def xs(rows: Seq[dict[str, Any]]) -> list[float]:
        return [position[r["sweep_value"]] for r in rows]

    _line_panel(flat[0], groups, color, xs, "deadline_attainment", 100.0)
    flat[0].set_title("deadline attainment (%), all requests with a deadline")
    _class_panel(flat[1], groups, color, xs)
    for ax, (title, row_key, scale) in zip(flat[2:], PANELS, strict=True):
        _line_panel(ax, groups, color, xs, row_key, scale)
        ax.set_title(title)
    offered = [(position[r["sweep_value"]], r["offered_request_rate"]) for r in next(iter(groups.values()), [])]
    offered = [(x, y) for x, y in offered if y is not None]
    if offered:
        flat[4].plot(*zip(*offered, strict=True), color="black", ls="--", lw=1, label="offered")
    flat[4].legend(fontsize=8)  # every configuration has a throughput line
    for name, rows in groups.items():
        knee = saturation_value(rows)
        if knee is not None:
            for ax in flat:
                ax.axvline(position[knee], color=color[name], ls=":", lw=1.2, alpha=0.8)
    for ax in flat:
        ax.set_xlabel(key)
        ax.grid(alpha=0.3)
        if not numeric:
            ax.set_xticks(range(len(values)), [str(v) for v in values])
    if flat[0].get_legend_handles_labels()[0]:  # no line without deadlines (the panel says so)
        flat[0].legend(fontsize=8)
    knees = ", ".join(
        f"{name}: {key}={_fmt(k)}" for name, rows in groups.items() if (k := saturation_value(rows)) is not None
    )
    reps = result.workload.get("replicates")
    fig.suptitle(
        f"{command}: {result.workload['name']}" + (f" ({reps['n']} replicates; bands: 95 % intervals)" if reps else "")
        + "\n"
        "dotted: the engine no longer keeps up (TTFT grows over the run) from there on"
        + (f" ({knees})" if knees else " (no configuration saturated)")
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _line_panel(ax: Any, groups: dict[str, list[dict[str, Any]]], color: dict[str, str], xs: Any,
                key: str, scale: float) -> None:  # fmt: skip
    seen: list[float] = []
    for name, rows in groups.items():
        points = [(x, r[key] * scale) for x, r in zip(xs(rows), rows, strict=True) if r.get(key) is not None]
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", color=color[name], label=name)
            seen.extend(y for _, y in points)
        band = [(x, r[key] * scale, r["ci95"][key] * scale) for x, r in zip(xs(rows), rows, strict=True)
                if r.get(key) is not None and (r.get("ci95") or {}).get(key) is not None]  # fmt: skip
        if band:  # replicates: the 95 % interval of the mean
            bx, mean, half = zip(*band, strict=True)
            low = [max(m - h, 0.0) if key.endswith("_s") else m - h for m, h in zip(mean, half, strict=True)]
            ax.fill_between(bx, low, [m + h for m, h in zip(mean, half, strict=True)], color=color[name], alpha=0.2)
            seen.extend(v for v in low if v > 0)
    if key.endswith("_s") and seen and min(seen) > 0 and max(seen) / min(seen) > 30:  # latencies past capacity
        ax.set_yscale("log")
    if not seen:
        why = "no --slo given" if key == "goodput" else "no request has it"
        ax.text(0.5, 0.5, why, ha="center", va="center", transform=ax.transAxes, color="gray")


def _class_panel(ax: Any, groups: dict[str, list[dict[str, Any]]], color: dict[str, str], xs: Any) -> None:
    """Deadline attainment per priority class: colour per configuration, line style per class."""
    labels = sorted(
        {c for rows in groups.values() for r in rows for c, s in ((r.get("classes") or {}).get("priority") or {}).items()
         if s.get("deadline_attainment") is not None},
        key=sort_label,
    )  # fmt: skip
    ax.set_title("deadline attainment (%) per priority class")
    if not labels:
        ax.text(0.5, 0.5, "one priority class, or no deadlines", ha="center", va="center",
                transform=ax.transAxes, color="gray")  # fmt: skip
        return
    for name, rows in groups.items():
        for i, label in enumerate(labels):
            points = []
            for x, r in zip(xs(rows), rows, strict=True):
                value = ((r.get("classes") or {}).get("priority") or {}).get(label, {}).get("deadline_attainment")
                if value is not None:
                    points.append((x, 100 * value))
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", ls=LINE_STYLES[i % len(LINE_STYLES)],
                        color=color[name], label=f"{name} priority={label}")  # fmt: skip
    ax.legend(fontsize=7)


def _fmt(value: float | str) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)
