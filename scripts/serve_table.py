"""One markdown table from guidellm 0.8.1 JSON reports, one row per report.

Usage: serve_table.py SERVER:STREAMS=REPORT.json ...   (a missing report prints a "failed" row)

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


def row(label: str, streams: str, path: Path) -> tuple[list[str], list[str]]:
    """The table row of one report and the warnings guidellm attached to it."""
    if not path.exists():
        return [label, streams, "failed (see its log)", "", "", "", "", ""], []
    bench = json.loads(path.read_text())["benchmarks"][0]
    m = {
        key: value["successful"]
        for key, value in bench["metrics"].items()
        if isinstance(value, dict) and "successful" in value
    }
    totals = bench["metrics"]["request_totals"]
    asked = bench["config"]["constraints"]["max_requests"]["args"]["count"]
    # "of": guidellm can end a run with a request in flight and record it nowhere (seen once, 1 of 2)
    done = f"{totals['successful']} / {totals['errored']} of {asked}"
    if totals["incomplete"]:
        done += f" (+{totals['incomplete']} cut)"
    cells = [
        label,
        str(bench["config"]["strategy"]["streams"]),
        done,
        f"{m['output_tokens_per_second']['mean']:.1f}",
        f"{m['output_token_count']['mean']:.1f}",
        f"{m['time_to_first_token_ms']['percentiles']['p50'] / 1000:.3f}",
        f"{m['inter_token_latency_ms']['percentiles']['p50']:.1f}",
        f"{m['request_latency']['mean']:.2f}",
    ]
    return cells, [f"{w['code']}: {w['message']}" for w in bench.get("warnings") or []]


def main(args: list[str]) -> None:
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * 2 + "---:|" * (len(COLUMNS) - 2))
    notes = []
    for arg in args:
        name, _, path = arg.partition("=")
        label, _, streams = name.partition(":")
        cells, warnings = row(label, streams, Path(path))
        print("| " + " | ".join(cells) + " |")
        notes += [f"- {label} @ {cells[1]} streams, guidellm warned {w}" for w in warnings]
    if notes:
        print("\n" + "\n".join(notes))


if __name__ == "__main__":
    main(sys.argv[1:])
