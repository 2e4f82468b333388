"""Each server's figures as a ratio to a baseline server's, per round, with a 95 % interval over the rounds.

Usage: serve_ratio.py --baseline NAME SERVER:STREAMS=REPORT.json[,REPORT.json...] ...
(the arguments serve_table.py takes; the reports of a row are its rounds, in order)

scripts/serve_vs_vllm.sh runs the servers of a round one after the other and
reverses their order every other round, so round k of a server and round k
of the baseline ran close together: the ratio is taken per round (paired),
and the interval is Student's t over the rounds' ratios (mean +- t * s /
sqrt(n)). The adapter's target (docs/vllm.md, "Speed"): the interval reaches
0.97 for output tokens/s and 1.03 for ITL p50, that is its upper end is at
least 0.97 and its lower end at most 1.03.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

from serve_table import read

# Two-sided 95 % quantiles of Student's t by degrees of freedom (n - 1 for n rounds).
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}
TARGETS = {"tok_s": ("out tok/s", lambda lo, hi: hi >= 0.97), "itl_ms": ("ITL p50", lambda lo, hi: lo <= 1.03)}


def interval(ratios: list[float]) -> tuple[float, float, float]:
    """(mean, low, high) of the 95 % t-interval; one round gives no interval."""
    mean = statistics.fmean(ratios)
    if len(ratios) < 2:
        return mean, math.nan, math.nan
    half = T95.get(len(ratios) - 1, 1.96) * statistics.stdev(ratios) / math.sqrt(len(ratios))
    return mean, mean - half, mean + half


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True)
    parser.add_argument("rows", nargs="+", metavar="SERVER:STREAMS=REPORT.json[,...]")
    args = parser.parse_args(argv)
    rows: dict[tuple[str, str], list[Path]] = {}
    for arg in args.rows:
        name, _, paths = arg.partition("=")
        server, _, streams = name.partition(":")
        rows[(server, streams)] = [Path(p) for p in paths.split(",")]
    print(f"| server | streams | rounds | out tok/s ratio to {args.baseline} (95 % interval) | ITL p50 ratio (95 % interval) | target met |")
    print("|---|---:|---:|---:|---:|---|")
    for (server, streams), paths in rows.items():
        base = rows.get((args.baseline, streams))
        if server == args.baseline or base is None:
            continue
        pairs = [(read(p), read(b)) for p, b in zip(paths, base, strict=True) if p.exists() and b.exists()]
        cells, met = [], []
        for key, (label, target) in TARGETS.items():
            mean, lo, hi = interval([p[key] / b[key] for p, b in pairs]) if pairs else (math.nan,) * 3
            cells.append(f"{mean:.3f} ({lo:.3f}-{hi:.3f})")
            met.append(f"{label} {'yes' if pairs and target(lo, hi) else 'no'}")
        print(f"| {server} | {streams} | {len(pairs)} of {len(paths)} | {cells[0]} | {cells[1]} | {', '.join(met)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
