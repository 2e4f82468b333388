"""Measured length tables: whole (prompt, output) pairs from the shipped arxiv-summarization counts."""

from __future__ import annotations

import pytest

from cbcore.bench.generator import generate
from cbcore.bench.length_tables import length_table
from cbcore.bench.workload import WorkloadError


def test_arxiv_pairs_are_drawn_whole_and_uncapped_unless_asked() -> None:
    table = length_table("arxiv-summarization")
    assert len(table) == 28257 and max(a + b for a, b in table) == 4096  # Sarathi-Serve's counts, as Vidur ships them
    pairs = set(table)
    w = generate("poisson:n=300,rate=2,lengths=arxiv-summarization,seed=4", vocab_size=1000)
    drawn = [(len(r.prompt_token_ids), r.max_new_tokens) for r in w.requests]
    assert all(p in pairs for p in drawn)  # a prompt keeps its own output length
    assert max(a for a, _ in drawn) > 1024  # the synthetic distributions' default cap of 1024 does not apply
    assert generate("poisson:n=300,rate=2,lengths=arxiv-summarization,seed=5", vocab_size=1000).requests != w.requests
    capped = generate("poisson:n=300,rate=2,lengths=arxiv-summarization,seed=4,max_input=1000", vocab_size=1000)
    assert max(len(r.prompt_token_ids) for r in capped.requests) == 1000
    assert [r.max_new_tokens for r in capped.requests] == [b for _, b in drawn]


def test_synthetic_shape_keys_are_refused_with_a_table() -> None:
    with pytest.raises(WorkloadError, match="input_len: lengths=arxiv-summarization draws measured"):
        generate("poisson:n=3,lengths=arxiv-summarization,input_len=100", vocab_size=1000)
    with pytest.raises(KeyError, match="unknown length table"):
        length_table("nope")
