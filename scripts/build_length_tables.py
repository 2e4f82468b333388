"""Build the length tables a workload generator can draw (prompt, output) token counts from.

``lengths=arxiv-summarization`` draws each request's prompt and output lengths,
as one pair, uniformly from the arxiv-summarization workload of the
Sarathi-Serve paper (Agrawal et al., OSDI 2024; Llama-2 tokenizer, 28,257
requests), as Vidur ships it (MIT licence). This script reads Vidur's CSV and
writes the compressed table the package carries:

    python scripts/build_length_tables.py \\
        ../shared/anchors/vidur/traces/arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv \\
        cbcore/bench/data/arxiv-summarization-lengths.csv.gz
"""

from __future__ import annotations

import argparse
import csv
import gzip
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="Vidur's CSV (num_prefill_tokens, num_decode_tokens, ...)")
    parser.add_argument("out", type=Path, help="the .csv.gz to write (input_len,output_len)")
    args = parser.parse_args()
    with args.source.open(newline="") as fh:
        rows = [(int(r["num_prefill_tokens"]), int(r["num_decode_tokens"])) for r in csv.DictReader(fh)]
    if not rows or min(min(r) for r in rows) < 1:
        raise SystemExit(f"{args.source}: expected positive token counts in every row")
    text = "input_len,output_len\n" + "".join(f"{a},{b}\n" for a, b in rows)
    # mtime=0: the same table always compresses to the same bytes.
    args.out.write_bytes(gzip.compress(text.encode(), compresslevel=9, mtime=0))
    print(f"{args.out}: {len(rows)} requests, {args.out.stat().st_size} bytes")


if __name__ == "__main__":
    main()
