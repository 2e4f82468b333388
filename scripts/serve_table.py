"""One markdown table from guidellm 0.8.1 JSON reports, one row per server and stream count.

Usage: serve_table.py SERVER:STREAMS=REPORT.json[,REPORT.json...] ...
(several reports: the rounds of one row, each figure their median; a missing report is counted as
a failed round, and a row with none prints "failed")

Every figure is guidellm's own, from ``benchmarks[0].metrics`` over the completed
requests: output tokens/s is their output tokens over the benchmark's duration;
TTFT and end-to-end latency are per request; ITL is per request too, (last token
- first token) / (tokens - 1), so its p50 is the median of per-request means
(weighted by tokens, which changes nothing when every request has 64). The token
counts are the server's own (``usage``); guidellm falls back to the requested
count when a server reports none, so "out tok/req" shows what was asked for then.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

COLUMNS = (
    "server",
    "streams",
    "ok / err of asked",
    "out tok/s",
    "out tok/req",
    "TTFT p50 (s)",
    "ITL p50 (ms)",
    "e2e mean (s)",
)
# The figures of a row, with their format: a round's own, or the median over the rounds.
FIGURES = (("tok_s", "{:.1f}"), ("tok_req", "{:.1f}"), ("ttft_s", "{:.3f}"), ("itl_ms", "{:.1f}"), ("e2e_s", "{:.2f}"))


def read(path: Path) -> dict:
    """One report's counts, figures and guidellm's warnings."""
    bench = json.loads(path.read_text())["benchmarks"][0]
    m = {
        key: value["successful"]
        for key, value in bench["metrics"].items()
        if isinstance(value, dict) and "successful" in value
    }
    totals = bench["metrics"]["request_totals"]
    return {
        "streams": bench["config"]["strategy"]["streams"],
        "asked": bench["config"]["constraints"]["max_requests"]["args"]["count"],
        "ok": totals["successful"],
        "err": totals["errored"],
        "cut": totals["incomplete"],
        "tok_s": m["output_tokens_per_second"]["mean"],
        "tok_req": m["output_token_count"]["mean"],
        "ttft_s": m["time_to_first_token_ms"]["percentiles"]["p50"] / 1000,
        "itl_ms": m["inter_token_latency_ms"]["percentiles"]["p50"],
        "e2e_s": m["request_latency"]["mean"],
        "warnings": [f"{w['code']}: {w['message']}" for w in bench.get("warnings") or []],
    }


def row(label: str, streams: str, paths: list[Path]) -> tuple[list[str], list[str]]:
    """The table row of one server and stream count over its rounds, and the warnings guidellm attached."""
    rounds = [read(p) for p in paths if p.exists()]
    if not rounds:
        return [label, streams, "failed (see its log)", "", "", "", "", ""], []
    # "of": guidellm can end a run with a request in flight and record it nowhere (seen once, 1 of 2)
    done = f"{sum(r['ok'] for r in rounds)} / {sum(r['err'] for r in rounds)} of {sum(r['asked'] for r in rounds)}"
    if cut := sum(r["cut"] for r in rounds):
        done += f" (+{cut} cut)"
    if len(paths) > 1:
        done += f", {len(rounds)} of {len(paths)} rounds"
    cells = [label, str(rounds[0]["streams"]), done]
    cells += [fmt.format(statistics.median(r[key] for r in rounds)) for key, fmt in FIGURES]
    return cells, [w for r in rounds for w in r["warnings"]]


def main(args: list[str]) -> None:
    usage = __doc__.split("\n\n")[1].split("\n")[0]
    rows = []  # every argument checked before the table starts
    for arg in args:
        name, _, paths = arg.partition("=")
        label, _, streams = name.partition(":")
        if not streams or not all(paths.split(",")):
            sys.exit(f"serve_table.py: {arg!r} is not SERVER:STREAMS=REPORT.json[,...]\n{usage}")
        rows.append((label, streams, [Path(p) for p in paths.split(",")]))
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * 2 + "---:|" * (len(COLUMNS) - 2))
    notes = []
    for label, streams, paths in rows:
        cells, warnings = row(label, streams, paths)
        print("| " + " | ".join(cells) + " |")
        notes += [f"- {label} @ {cells[1]} streams, guidellm warned {w}" for w in warnings]
    if notes:
        print("\n" + "\n".join(notes))


if __name__ == "__main__":
    main(sys.argv[1:])
