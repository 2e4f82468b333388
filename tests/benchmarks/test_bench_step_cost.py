"""The cost of a step: cbcore's engine against HF's batched decode (DynamicCache), side by side.

``pytest tests/benchmarks/test_bench_step_cost.py --benchmark-enable -s`` loads
the default model (SmolLM2-135M, fp32, CPU) and measures, for widths 1-64,
contexts 128 and 1024 and 1 and 2 torch threads, the median time of one
decode step of each side, the two alternating within one process (see
:mod:`cbcore.bench.stepcost`), plus mixed steps (decodes and one whole
prompt) against HF's decode plus HF's prefill of the same prompt. It prints
the table with the ratio cbcore / HF (below 1.0: cbcore's step is cheaper).

Without ``--benchmark-enable`` (the default addopts) a few small cells run
once on a tiny random model, as a plain test of the machinery.
"""

from __future__ import annotations

import os

import pytest

from cbcore.bench.stepcost import EngineDecode, StepCost, decode_cell, format_table, forward_cell, mixed_cell
from cbcore.testing import tiny_model

WIDTHS = [1, 2, 3, 4, 8, 16, 32, 64]
CONTEXTS = [128, 1024]
THREADS = [int(t) for t in os.environ.get("CB_BENCH_THREADS_LIST", "1,2").split(",")]
MIXED = [(8, 128, 128), (3, 128, 256)]  # (decodes, their context, prompt length)
CELLS: list[StepCost] = []


@pytest.fixture(scope="module")
def model(request):
    if request.config.getoption("benchmark_enable", False):
        from cbcore.config import ModelConfig
        from cbcore.models.loading import load_model_and_tokenizer

        return load_model_and_tokenizer(None, ModelConfig())[0]
    return tiny_model("llama")


@pytest.fixture(scope="module", autouse=True)
def print_table(request):
    yield
    if not CELLS:
        return
    plugins = request.config.pluginmanager
    write = plugins.get_plugin("terminalreporter").write_line
    with plugins.get_plugin("capturemanager").global_and_fixture_disabled():
        write("")
        write("step cost, median ms per step, cbcore (sdpa) vs HF batched decode:")
        for line in format_table(
            sorted(CELLS, key=lambda c: (c.label != "decode", c.threads, c.context, c.width))
        ).splitlines():
            write(line)


def _run(request, benchmark, cell_fn):
    cost = benchmark.pedantic(cell_fn, rounds=1, iterations=1) if benchmark.enabled else cell_fn()
    assert cost.hf_s > 0 and cost.cbcore_s > 0
    if benchmark.enabled:
        CELLS.append(cost)
        # Each cell as soon as it is measured: the whole grid takes long on a small machine.
        plugins = request.config.pluginmanager
        with plugins.get_plugin("capturemanager").global_and_fixture_disabled():
            plugins.get_plugin("terminalreporter").write_line(" " + format_table([cost]).splitlines()[-1])
    return cost


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("width", WIDTHS)
def test_decode_step(request, benchmark, model, width, context, threads):
    _decode(request, benchmark, model, width, context, threads, decode_cell)


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("width", [1, 4, 16, 64])
def test_fused_forward_against_hf_modules(request, benchmark, model, width, context, threads):
    """The same engine step with the fused forward and through HF's modules (``hf_s``)."""
    _decode(request, benchmark, model, width, context, threads, forward_cell)


def _decode(request, benchmark, model, width, context, threads, cell):
    if not benchmark.enabled:
        if (width, context, threads) not in {(1, 128, 1), (3, 128, 1)}:
            pytest.skip("the full grid runs with --benchmark-enable")
        context = 24  # the tiny model's positions are few
    benchmark.group = f"decode ctx {context}"
    rounds, steps = (3, 1) if benchmark.enabled else (1, 1)
    _run(request, benchmark, lambda: cell(model, width, context, threads, rounds=rounds, steps=steps))


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize(("width", "context", "prompt"), MIXED)
def test_mixed_step(request, benchmark, model, width, context, prompt, threads):
    if not benchmark.enabled:
        if threads != 1 or width != 3:
            pytest.skip("the full grid runs with --benchmark-enable")
        context, prompt = 24, 16
    benchmark.group = "mixed"
    rounds = 3 if benchmark.enabled else 1
    _run(request, benchmark, lambda: mixed_cell(model, width, context, prompt, threads, rounds=rounds))


def test_decode_state_is_what_the_cell_claims():
    """The engine side really holds ``width`` sequences decoding at ``context`` tokens."""
    side = EngineDecode(tiny_model("llama"), 3, 20, 4)
    running = list(side.engine.scheduler.running)
    assert len(running) == 3
    assert all(s.num_pending_tokens == 1 and s.num_tokens == 21 for s in running)
    before = side.engine.step_totals.steps
    side.step()
    last = side.engine.step_stats[-1]
    assert side.engine.step_totals.steps == before + 1
    assert (last.num_seqs, last.num_decode_tokens, last.num_prefill_tokens) == (3, 3, 0)


def test_every_sequence_starts_decoding_together_and_lasts_the_timed_steps():
    """Wide cells at long contexts: nobody decodes during the setup, nobody finishes while timed."""
    side = EngineDecode(tiny_model("llama"), 8, 300, 4)
    assert [s.num_tokens for s in side.engine.scheduler.running] == [301] * 8
    for _ in range(4):
        side.step()
    assert side.engine.step_stats[-1].num_decode_tokens == 8


def test_the_mixed_cell_prefills_its_whole_prompt_in_every_timed_step():
    side = EngineDecode(tiny_model("llama"), 3, 20, 4, prefill=16)
    for _ in range(3):
        side.step()
        last = side.engine.step_stats[-1]
        assert (last.num_decode_tokens, last.num_prefill_tokens) == (3, 16)  # no prefix-cache hit
