"""Measured length tables: (prompt, output) token counts a generator draws as pairs, with replacement.

A synthetic distribution (fixed, uniform, a log-normal ShareGPT shape) is
enough to compare policies; a reproduction needs the lengths the paper used.
A table keeps each request's prompt and output length together (their
correlation is part of the workload) and the generator draws whole pairs.

* ``arxiv-summarization``: the Sarathi-Serve paper's arxiv-summarization
  workload (Llama-2 tokenizer; 28,257 requests; prompts median 2,730, mean
  2,588, at most 4,054 tokens; outputs median 167, mean 291; prompt + output at
  most 4,096), from Vidur's processed traces (MIT; ``data/LICENSE-vidur-MIT``).
"""

from __future__ import annotations

import csv
import gzip
import io
from functools import cache
from pathlib import Path

DATA = Path(__file__).with_name("data")
#: Table name -> file in ``data/`` (columns input_len, output_len).
TABLES = {"arxiv-summarization": "arxiv-summarization-lengths.csv.gz"}


@cache
def length_table(name: str) -> tuple[tuple[int, int], ...]:
    """Every (prompt, output) pair of the table ``name``."""
    if name not in TABLES:
        raise KeyError(f"unknown length table {name!r}; known: {', '.join(TABLES)}")
    text = gzip.decompress((DATA / TABLES[name]).read_bytes()).decode()
    return tuple((int(r["input_len"]), int(r["output_len"])) for r in csv.DictReader(io.StringIO(text)))
