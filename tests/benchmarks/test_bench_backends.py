"""Attention backends side by side on the same packed step.

``pytest tests/benchmarks/test_bench_backends.py --benchmark-enable`` times one
step's attention (plan + every layer) per backend and batch size, then prints
each backend's median time relative to eager. Without ``--benchmark-enable``
(the default addopts) every case runs once, as a plain test of the setup.

The step mixes what a serving step carries: decodes with 64–320 tokens of
context, one prefill chunk after 128 tokens of context, and one fresh prompt,
with SmolLM2-135M's attention shape (9 query heads sharing 3 KV heads, head_dim
64). ``CB_BENCH_DEVICE=cuda`` runs it on a GPU in bfloat16 with 256-token pages,
where flash-varlen joins in. On CPU the step runs on ``CB_BENCH_THREADS`` torch
threads (default 1): on a small shared machine more threads mostly measure
contention with whatever else runs there.
"""

from __future__ import annotations

import os
from collections import defaultdict

import pytest
import torch
from support.attention_batches import packed_step, torch_threads

from cbcore.execution.backend import BackendUnavailable
from cbcore.plugins import get_registry

DEVICE = torch.device(os.environ.get("CB_BENCH_DEVICE", "cpu"))
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
BLOCK_SIZE = 256 if DEVICE.type == "cuda" else 16
LAYERS = 8
GEOMETRY = {"num_heads": 9, "num_kv_heads": 3, "head_dim": 64}
BATCH_SIZES = [8, 16, 32]
SCALE = 64**-0.5
THREADS = int(os.environ.get("CB_BENCH_THREADS", "1"))


def step_layout(num_seqs: int) -> list[tuple[int, int]]:
    """``num_seqs - 2`` decodes, one chunk after context, one fresh prompt."""
    decodes = [(64 + (37 * i) % 256, 1) for i in range(num_seqs - 2)]
    return [*decodes, (128, 32), (0, 48)]


def usable_backends() -> list[str]:
    names = []
    for entry in sorted(get_registry().entries("backend"), key=lambda e: e.name):
        try:
            entry.cls().check(DEVICE, BLOCK_SIZE, DTYPE)
        except BackendUnavailable:
            continue
        names.append(entry.name)
    return names


BACKENDS = usable_backends()
MEDIANS: dict[int, dict[str, float]] = defaultdict(dict)


@pytest.fixture(scope="module", autouse=True)
def ratio_table(request):
    with torch_threads(THREADS):
        yield
    if not MEDIANS:
        return
    plugins = request.config.pluginmanager
    write = plugins.get_plugin("terminalreporter").write_line
    with plugins.get_plugin("capturemanager").global_and_fixture_disabled():
        write("")
        where = f"{DEVICE}" if DEVICE.type == "cuda" else f"cpu, {THREADS} thread(s)"
        write(f"attention step ({where}, {DTYPE}, {LAYERS} layers), median time relative to eager:")
        for num_seqs, times in sorted(MEDIANS.items()):
            base = times.get("eager")
            cells = []
            for name, seconds in sorted(times.items()):
                speedup = f" = {base / seconds:.2f}x faster" if base and name != "eager" else ""
                cells.append(f"{name} {seconds * 1e3:.2f} ms{speedup}")
            write(f"  {num_seqs:>3} seqs: " + "; ".join(cells))


@pytest.mark.parametrize("num_seqs", BATCH_SIZES)
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_attention_step(benchmark, backend_name, num_seqs):
    step = packed_step(
        step_layout(num_seqs),
        block_size=BLOCK_SIZE,
        num_layers=LAYERS,
        dtype=DTYPE,
        device=DEVICE,
        **GEOMETRY,
    )
    backend = get_registry().create("backend", backend_name, {}, "backend")
    backend.check(DEVICE, BLOCK_SIZE, DTYPE)

    def attention_step() -> torch.Tensor:
        step.batch.scratch.clear()  # per-step plans are part of the cost
        for layer in range(LAYERS):
            out = backend.forward(
                step.query, step.key, step.value, layer, step.batch, step.cache, SCALE, None
            )
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
        return out

    benchmark.group = f"{num_seqs} seqs"
    with torch.inference_mode():
        out = benchmark(attention_step)
    assert out.shape == step.query.shape and torch.isfinite(out).all()
    if benchmark.enabled:
        MEDIANS[num_seqs][backend_name] = benchmark.stats.stats.median
