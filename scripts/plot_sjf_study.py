"""The SJF figure of docs/reproductions.md: each SJF row's latency change against fcfs, per setting.

Takes `cb simulate --json` files run with --replicates (one or more; a sweep's
rows are named ``ROW rate=R``); every row named ``fcfs`` (at the same sweep
value) is the baseline. Each bar is the mean over replicates of the relative
change (SJF - fcfs) / fcfs, paired replicate by replicate on the same trace
window, with its 95 % interval:

    python scripts/plot_sjf_study.py docs/img/repro-sjf.png "256 seqs:sjf.json" "32 seqs, rate=4:sjf32.json"
"""

from __future__ import annotations

import argparse
import json

from cbcore.bench.report import pyplot
from cbcore.bench.stats import mean_interval

PANELS = (
    ("e2e_mean_s", "mean end-to-end latency"),
    ("e2e_p99_s", "p99 end-to-end latency"),
    ("ttft_mean_s", "mean TTFT"),
    ("ttft_p99_s", "p99 TTFT"),
)


def settings(label: str, path: str) -> dict[str, dict[str, dict]]:
    """``{setting: {row: row dict}}``: one setting per file and sweep value."""
    with open(path) as fh:
        data = json.load(fh)
    out: dict[str, dict[str, dict]] = {}
    for row in data["rows"]:
        if "error" in row:
            continue
        name, _, value = row["name"].partition(" ")
        out.setdefault(f"{label}, {value}" if value else label, {})[name] = row
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("inputs", nargs="+", help="LABEL:FILE.json (LABEL names the file's setting)")
    args = parser.parse_args()
    groups: dict[str, dict[str, dict]] = {}
    for item in args.inputs:
        label, _, path = item.partition(":")
        groups.update(settings(label, path))
    plt = pyplot()
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 4.6), sharey=False)
    names = list(dict.fromkeys(n for rows in groups.values() for n in rows if n != "fcfs"))
    width = 0.8 / len(names)
    for ax, (key, title) in zip(axes, PANELS, strict=True):
        for i, name in enumerate(names):
            means, halves = [], []
            for rows in groups.values():
                if name not in rows:  # a setting run without this row: no bar
                    means.append(float("nan"))
                    halves.append(0.0)
                    continue
                a, b = rows[name]["replicate_values"][key], rows["fcfs"]["replicate_values"][key]
                iv = mean_interval([100 * (x - y) / y for x, y in zip(a, b, strict=True)])
                means.append(iv.mean)
                halves.append(iv.half_width or 0.0)
            xs = [g + (i - (len(names) - 1) / 2) * width for g in range(len(groups))]
            ax.bar(xs, means, width, yerr=halves, capsize=2, color=f"C{i + 1}", label=name)
        ax.axhline(0, color="black", lw=0.8)
        ax.set_xticks(range(len(groups)), [g.replace(", ", "\n") for g in groups], fontsize=8)
        ax.set_title(f"{title}: change against fcfs (%)", fontsize=10)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=8)
    fig.suptitle("SJF with oracle and noisy length predictors against fcfs (bars: 95 % intervals, paired)")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
