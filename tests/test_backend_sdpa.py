"""The sdpa backend: same numbers as eager, but each query only meets its own keys."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import CAPS, PROMPTS
from support.attention_batches import MIXED_STEP, packed_step, torch_threads

import cbcore.backends.sdpa as sdpa_module
from cbcore import Engine, EngineConfig, SamplingParams
from cbcore.backends.eager import EagerBackend
from cbcore.backends.sdpa import SdpaBackend, visible_key_range
from cbcore.plugins import get_registry
from cbcore.testing import assert_equivalent, compare_greedy, reference_generate, tiny_model
from cbcore.testing.mixes import available_mixes

SCALE = 0.25


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with torch_threads(1):
        yield


DECODE_PATHS = ["paged", "gather"]


def sdpa(decode="auto"):
    return SdpaBackend(SdpaBackend.Params(decode=decode))


def both(step, window, layer=0, decode="auto"):
    eager = EagerBackend().forward(
        step.query, step.key, step.value, layer, step.batch, step.cache, SCALE, window
    )
    step.batch.scratch.clear()
    fast = sdpa(decode).forward(
        step.query, step.key, step.value, layer, step.batch, step.cache, SCALE, window
    )
    return eager, fast


@pytest.mark.parametrize("decode", DECODE_PATHS)
@pytest.mark.parametrize("window", [None, 1, 5, 16, 1000])
@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 2), (4, 4), (6, 1)])
def test_matches_eager_on_a_mixed_step(window, heads, kv_heads, decode):
    step = packed_step(MIXED_STEP, num_heads=heads, num_kv_heads=kv_heads)
    eager, fast = both(step, window, decode=decode)
    assert fast.shape == step.query.shape
    torch.testing.assert_close(fast, eager, atol=2e-6, rtol=1e-5)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seqs=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 20)), min_size=1, max_size=6),
    window=st.one_of(st.none(), st.integers(1, 30)),
    block_size=st.sampled_from([1, 4, 16]),
    decode=st.sampled_from(DECODE_PATHS),
)
def test_matches_eager_on_any_layout(seqs, window, block_size, decode):
    step = packed_step(seqs, block_size=block_size, num_heads=4, num_kv_heads=2, head_dim=8)
    eager, fast = both(step, window, decode=decode)
    torch.testing.assert_close(fast, eager, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [5, 64, 128])
def test_paged_decode_matches_eager_at_real_head_sizes(head_dim):
    step = packed_step([(300, 1), (7, 1), (64, 1), (129, 1)], num_heads=9, num_kv_heads=3, head_dim=head_dim)
    eager, fast = both(step, None, decode="paged")
    torch.testing.assert_close(fast, eager, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_stays_close_to_float32(dtype):
    ref = packed_step(MIXED_STEP)
    eager32, _ = both(ref, 8)
    step = packed_step(MIXED_STEP, dtype=dtype)
    fast = SdpaBackend().forward(step.query, step.key, step.value, 0, step.batch, step.cache, SCALE, 8)
    assert fast.dtype == dtype  # auto: half precision gathers (the paged kernel is float32)
    torch.testing.assert_close(fast.float(), eager32, atol=3e-2, rtol=3e-2)


def test_plan_is_built_once_per_step(monkeypatch):
    calls = []
    real = sdpa_module.build_plan
    monkeypatch.setattr(sdpa_module, "build_plan", lambda *a: calls.append(a) or real(*a))
    step = packed_step(MIXED_STEP, num_layers=3)
    backend = SdpaBackend()
    for layer in range(3):
        backend.forward(step.query, step.key, step.value, layer, step.batch, step.cache, SCALE, None)
    assert len(calls) == 1
    # A layer with another window (interleaved sliding/global layers) gets its own plan.
    backend.forward(step.query, step.key, step.value, 0, step.batch, step.cache, SCALE, 4)
    assert len(calls) == 2


def test_decode_only_step_pads_keys_without_a_token_by_key_mask():
    seqs = [(9, 1), (30, 1), (2, 1), (17, 1)]
    step = packed_step(seqs)
    plan = SdpaBackend.plan(step.batch, None, torch.float32, paged=False)
    assert plan.spans == [] and plan.decode is not None
    assert plan.decode.rows is None  # every row is a decode row, in order
    keys = plan.decode.keys
    assert keys.slots.shape == (4, 31)
    assert keys.mask.shape == (4, 1, 1, 31)
    visible = (keys.mask == 0).sum(-1).flatten().tolist()
    assert visible == [10, 31, 3, 18]
    # Equal lengths need no mask at all.
    even = packed_step([(5, 1), (5, 1)])
    assert SdpaBackend.plan(even.batch, None, torch.float32, paged=False).decode.keys.mask is None
    # The paged kernel copies nothing: it is told where each row's keys lie.
    paged = SdpaBackend.plan(step.batch, 4, torch.float32, paged=True).decode.keys
    assert paged.starts.tolist() == [6, 27, 0, 14] and paged.counts.tolist() == [4, 4, 3, 4]
    assert torch.equal(paged.tables, step.batch.block_tables)


def test_each_sequence_reads_only_its_own_blocks():
    step = packed_step(MIXED_STEP)
    batch = step.batch
    plan = SdpaBackend.plan(batch, None, torch.float32, paged=False)
    decode_ids = [i for i, q in enumerate(batch.query_lens) if q == 1]
    for row, i in enumerate(decode_ids):
        blocks = set(batch.block_tables[i, : -(-batch.context_lens[i] // batch.block_size)].tolist())
        assert {s // batch.block_size for s in plan.decode.keys.slots[row].tolist()} <= blocks
    span_ids = [i for i, q in enumerate(batch.query_lens) if q > 1]
    for span, i in zip(plan.spans, span_ids, strict=True):
        assert span.q_end - span.q_start == batch.query_lens[i]
        if span.fresh:  # a whole prompt: its keys are this step's, read without touching the cache
            assert span.slots is None and batch.context_lens[i] == batch.query_lens[i]
        else:
            assert span.slots.numel() == batch.context_lens[i]
            assert {s // batch.block_size for s in span.slots.tolist()} <= set(batch.block_tables[i].tolist())


def test_chunk_after_context_is_causal_from_the_bottom_right():
    step = packed_step([(5, 3)])
    (span,) = SdpaBackend.plan(step.batch, None, torch.float32, paged=True).spans
    allowed = (span.mask == 0).int().tolist()
    assert allowed == [[1] * 6 + [0, 0], [1] * 7 + [0], [1] * 8]
    fresh = packed_step([(0, 4)])
    (square,) = SdpaBackend.plan(fresh.batch, None, torch.float32, paged=False).spans
    assert square.mask is None  # left to SDPA's own is_causal
    kernel = SdpaBackend.plan(fresh.batch, None, torch.float32, paged=True)  # or to the CPU's prompt kernel
    assert kernel.spans == [] and kernel.prompts.lens.tolist() == [4]


def test_sliding_window_skips_keys_no_query_can_see():
    assert visible_key_range(100, 1, None) == (0, 100)
    assert visible_key_range(100, 1, 8) == (92, 100)
    assert visible_key_range(100, 10, 8) == (83, 100)
    assert visible_key_range(5, 5, 8) == (0, 5)
    step = packed_step([(40, 1), (3, 1), (20, 6)])
    plan = SdpaBackend.plan(step.batch, 8, torch.float32, paged=False)
    assert plan.decode.keys.slots.shape[1] == 8
    (span,) = plan.spans
    assert span.slots.numel() == 26 - 13  # keys 13..25: the first query (20) still sees 13
    allowed = (span.mask == 0).sum(-1).tolist()
    assert allowed == [8] * 6


def test_registered_and_the_default():
    assert get_registry().get("backend", "sdpa").cls is SdpaBackend
    assert EngineConfig().backend.name == "sdpa"
    assert SdpaBackend.unavailable_reason(torch.device("cpu")) is None


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_eager(dtype):
    ref = packed_step(MIXED_STEP, num_layers=1)
    eager, _ = both(ref, 6)
    step = packed_step(MIXED_STEP, dtype=dtype, device="cuda")
    fast = SdpaBackend().forward(step.query, step.key, step.value, 0, step.batch, step.cache, SCALE, 6)
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(fast.float().cpu(), eager, atol=tol, rtol=tol)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_cuda_engine_float32_greedy_is_token_exact(family):
    model = tiny_model(family).to("cuda")
    references = reference_generate(model, PROMPTS, CAPS)
    mix = available_mixes()["priority+chunked+swap"]
    engine = Engine(model, config=EngineConfig.model_validate({**mix, "backend": {"name": "sdpa"}}))
    outputs = engine.generate(PROMPTS, [SamplingParams(max_new_tokens=c) for c in CAPS])
    assert_equivalent(compare_greedy(model, outputs, references))
    assert engine.scheduler.num_preemptions > 0
