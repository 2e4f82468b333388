"""Presenting a capacity search: the table of capacities, the points each search visited, and a figure."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

from cbcore.bench.capacity import BOUNDS
from cbcore.bench.suite import BenchResult

#: How each bound's measured value is shown: (scale, unit).
SHOW = {"itl_p99_s": (1000, "ms"), "queue_p50_s": (1000, "ms"), "slo_attainment": (100, "%")}


def capacity_table(result: BenchResult) -> str:
    info = result.workload["capacity"]
    lines = [f"workload {result.workload['name']} at varied rate="]
    if info.get("method"):
        lines.append(f"{info['method']}; capacity: mean ± half-width of the 95 % interval")
    for k, objective in enumerate(info["objectives"]):
        rows = [r for r in result.rows if r.get("objective_index") == k]
        lines.append("")
        lines.extend(_objective_table(objective, info["specs_objective"][k], info["tolerances"][k], rows))
    return "\n".join(lines)


def _objective_table(objective: str, spec: dict[str, Any], tol: float, rows: Seq[dict[str, Any]]) -> list[str]:
    bounds = BOUNDS[spec["kind"]]
    lines = [
        f"capacity: the highest arrival rate (req/s) with {objective}",
        f"search: from the start rate, doubling or halving until one rate meets it and one misses, then bisecting "
        f"to within {100 * tol:g} % (the threshold lies between the capacity and the next rate tried)",
    ]
    header = ["config", "capacity req/s", "per replicate", "runs", *(f"{b[3]} at cap." for b in bounds), "failed at cap."]
    body = []
    for row in rows:
        if "error" in row:
            continue
        half = row["ci95"]["capacity_req_s"]
        cap = f"{row['capacity_req_s']:.4g}" + (f" ± {half:.2g}" if half else "")
        if row["censored"]:
            cap += f" ({', '.join(row['censored'])})"
        cells = [row["name"], cap, " ".join(f"{v:.4g}" for v in row["replicate_values"]["capacity_req_s"]), str(row["runs"])]
        for key, _, _, _ in bounds:
            value = row.get(f"{key}_at_capacity")
            scale, unit = SHOW.get(key, (1, ""))
            cells.append("-" if value is None else f"{value * scale:.4g} {unit}".strip())
        failed = row.get("failed_at_capacity")
        cells.append("-" if failed is None else f"{failed:g}")
        body.append(cells)
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]

    def fmt(cells: Seq[str]) -> str:
        return "  ".join([cells[0].ljust(widths[0]), *(c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True))])

    lines += [fmt(header), fmt(["-" * w for w in widths]), *(fmt(b) for b in body)]
    lines.extend(f"{r['name']}: FAILED: {r['error']}" for r in rows if "error" in r)
    lines.append("points visited (rate in req/s; + met the objective, - missed it):")
    for row in rows:
        for i, s in enumerate(row.get("searches", ())):
            points = " ".join(f"{v['rate']:.4g}{'+' if v['meets'] else '-'}" for v in s["visited"])
            tag = f" [replicate {i}]" if len(row["searches"]) > 1 else ""
            note = "" if s["converged"] else " (stopped at max_runs before the tolerance was reached)"
            lines.append(f"  {row['name']}{tag}: {points}{note}")
    return lines


def plot_capacity(result: BenchResult, path: str | Path, command: str) -> None:
    """Per objective: each bound's value against the rate at every visited point, and the capacities."""
    from cbcore.bench.report import pyplot

    plt = pyplot()
    info = result.workload["capacity"]
    specs = info["specs_objective"]
    width = max(len(BOUNDS[s["kind"]]) for s in specs) + 1
    fig, grid = plt.subplots(len(specs), width, figsize=(5.5 * width, 4.6 * len(specs)), squeeze=False)
    names = list(dict.fromkeys(r["name"] for r in result.rows))
    color = {n: f"C{i % 10}" for i, n in enumerate(names)}
    for k, spec in enumerate(specs):
        axes = grid[k]
        rows = [r for r in result.rows if r.get("objective_index") == k and "error" not in r]
        bounds = BOUNDS[spec["kind"]]
        for ax, (key, field, scale, label) in zip(axes, bounds, strict=False):
            show, unit = SHOW.get(key, (1, ""))
            for row in rows:
                _points(ax, row, key, show, color[row["name"]])
            limit = float(spec.get(field, 2000.0 if field == "delay" else 0.0)) * scale * show
            ax.axhline(limit, color="black", ls="--", lw=1, label=f"objective {limit:g} {unit}")
            ax.set_xlabel("arrival rate (req/s)")
            ax.set_ylabel(f"{label} ({unit})")
            ax.set_title(f"{label}, each rate tried (filled: met)", fontsize=10)
            if key.endswith("_s"):
                ax.set_yscale("log")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        for ax in axes[len(bounds) : -1]:
            ax.axis("off")
        bar = axes[-1]
        labels = [r["name"] for r in rows]
        bar.barh(labels, [r["capacity_req_s"] for r in rows], color=[color[n] for n in labels],
                 xerr=[r["ci95"]["capacity_req_s"] or 0.0 for r in rows])  # fmt: skip
        bar.invert_yaxis()
        bar.set_xlabel("capacity (req/s)")
        bar.set_title("capacity:\n" + textwrap.fill(info["objectives"][k], 60), fontsize=9)
        bar.grid(alpha=0.3, axis="x")
    reps = info["replicates"]
    fig.suptitle(f"{command}: capacity of {result.workload['name']} ({reps} replicate(s); bars: 95 % intervals)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _points(ax: Any, row: dict[str, Any], key: str, scale: float, color: str) -> None:
    first = True
    for s in row["searches"]:
        pts: Seq[dict[str, Any]] = sorted(s["visited"], key=lambda v: v["rate"])
        xs = [v["rate"] for v in pts if v.get(key) is not None]
        ys = [v[key] * scale for v in pts if v.get(key) is not None]
        ax.plot(xs, ys, color=color, alpha=0.4, lw=1, label=row["name"] if first else None)
        first = False
        for v in pts:
            if v.get(key) is not None:
                ax.plot(v["rate"], v[key] * scale, "o", color=color, mfc=color if v["meets"] else "white")
