"""The victim-choice figure of docs/reproductions.md from `cb simulate --json` rows named ``kv-F/VICTIM``.

Each panel is one metric against the KV capacity (as a fraction of the
profile's), one line per victim rule, with the 95 % interval of each mean
(replicates) as error bars:

    python scripts/plot_victim_study.py victim.json docs/img/repro-victim.png
"""

from __future__ import annotations

import argparse
import json
import re

PANELS = (
    ("recomputed_tokens", "tokens computed again (recompute preemption)", 1.0),
    ("recompute_share", "share of computed tokens that were recomputed (%)", 100.0),
    ("preemptions", "preemptions", 1.0),
    ("ttft_mean_s", "TTFT mean (s)", 1.0),
    ("ttft_p99_s", "TTFT p99 (s)", 1.0),
    ("output_tokens_per_s", "output tokens/s", 1.0),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json")
    parser.add_argument("out")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(args.json) as fh:
        data = json.load(fh)
    lines: dict[str, list[tuple[float, dict]]] = {}
    for row in data["rows"]:
        match = re.fullmatch(r"kv-([0-9.]+)/(.+)", row["name"])
        if match and "error" not in row:
            lines.setdefault(match.group(2), []).append((float(match.group(1)), row))
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    for ax, (key, title, scale) in zip(axes.flat, PANELS, strict=True):
        for i, (victim, points) in enumerate(sorted(lines.items())):
            points.sort(key=lambda p: p[0])
            xs = [x for x, r in points if r.get(key) is not None]
            ys = [r[key] * scale for _, r in points if r.get(key) is not None]
            errs = [((r.get("ci95") or {}).get(key) or 0.0) * scale for _, r in points if r.get(key) is not None]
            ax.errorbar(xs, ys, yerr=errs, marker="o", capsize=3, color=f"C{i}", label=victim)
        ax.set_xscale("log")
        ax.minorticks_off()
        ax.set_xticks([x for x, _ in next(iter(lines.values()))], [f"{x:g}" for x, _ in next(iter(lines.values()))])
        ax.set_xlabel("KV capacity (fraction of the profile's)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    reps = data["workload"].get("replicates", {}).get("n", 1)
    fig.suptitle(f"victim choice: {data['workload']['name']} ({reps} replicates; bars: 95 % intervals)")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
