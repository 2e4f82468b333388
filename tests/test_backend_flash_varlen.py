"""flash-varlen: its CPU-side plan everywhere, its kernels where CUDA is.

On CPU the kernels are replaced by an emulator of FlashAttention's documented
varlen semantics (bottom-right causal, ``window_size=(left, right)``, paged K/V
through ``block_table``), so the arguments the backend builds — cu_seqlens,
seqused_k, block tables, the window — are checked against eager end to end.
The real kernels are checked on CUDA (``-m cuda``).
"""

from __future__ import annotations

import functools
import importlib.metadata
import itertools

import pytest
import torch
from support import CAPS, CLIENTS, PRIORITIES, PROMPTS
from support.attention_batches import MIXED_STEP, packed_step, torch_threads

import cbcore.backends.flash_varlen as fv
from cbcore import Engine, EngineConfig, SamplingParams
from cbcore.backends.eager import EagerBackend
from cbcore.backends.flash_varlen import FlashVarlenBackend, build_varlen_metadata, varlen_window
from cbcore.execution.backend import BackendUnavailable
from cbcore.testing import assert_equivalent, compare_topk, reference_generate, tiny_model
from cbcore.testing.mixes import available_mixes

SCALE = 0.25


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with torch_threads(1):
        yield


def emulate(q, k, v, cu_q, lengths, cu_k, block_table, window, scale):
    """FlashAttention varlen, as its docstring defines it, in float32 torch."""
    left, right = window
    out = torch.empty(q.shape, dtype=torch.float32)
    for b, n_k in enumerate(lengths):
        qs, qe = cu_q[b], cu_q[b + 1]
        if block_table is not None:  # k: [num_blocks, page, Hkv, D]
            pos = torch.arange(n_k)
            pages = block_table[b].long()[pos // k.shape[1]]
            kb, vb = k[pages, pos % k.shape[1]], v[pages, pos % k.shape[1]]
        else:  # k: [total_k, Hkv, D]
            kb, vb = k[cu_k[b] : cu_k[b] + n_k], v[cu_k[b] : cu_k[b] + n_k]
        group = q.shape[1] // kb.shape[1]
        kb, vb = kb.repeat_interleave(group, 1).float(), vb.repeat_interleave(group, 1).float()
        i = torch.arange(qe - qs)[:, None] + (n_k - (qe - qs))  # bottom-right aligned
        j = torch.arange(n_k)[None, :]
        allowed = j <= i + right if right >= 0 else torch.ones_like(j <= i)
        if left >= 0:
            allowed = allowed & (j >= i - left)
        scores = torch.einsum("qhd,khd->hqk", q[qs:qe].float(), kb) * scale
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[qs:qe] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vb)
    return out.to(q.dtype)


def _int32_plan(cu_q, cu_k, max_q, max_k, block_table):
    assert cu_q.dtype == cu_k.dtype == torch.int32 and cu_q.is_contiguous() and cu_k.is_contiguous()
    if block_table is not None:
        assert block_table.dtype == torch.int32 and block_table.stride(-1) == 1
    assert max_q == int((cu_q[1:] - cu_q[:-1]).max())
    return cu_q.tolist(), cu_k.tolist()


def fake_torch_kernel(
    q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size, enable_gqa, seqused_k, block_table
):
    """Signature of torch.nn.attention.varlen.varlen_attn."""
    assert isinstance(window_size, tuple) and enable_gqa == (q.shape[1] != k.shape[-2])
    assert (block_table is None) == (seqused_k is None), "a block table needs seqused_k"
    cq, ck = _int32_plan(cu_q, cu_k, max_q, max_k, block_table)
    lengths = seqused_k.tolist() if seqused_k is not None else [b - a for a, b in itertools.pairwise(ck)]
    assert max_k == max(lengths)
    return emulate(q, k, v, cq, lengths, ck, block_table, window_size, scale)


def fake_flash_attn_kernel(
    q, k, v, cu_q, cu_k, max_q, max_k, *, softmax_scale, causal, window_size, block_table
):
    """Signature of flash_attn.flash_attn_varlen_func."""
    assert causal is True
    cq, ck = _int32_plan(cu_q, cu_k, max_q, max_k, block_table)
    lengths = [b - a for a, b in itertools.pairwise(ck)]
    assert max_k == max(lengths)
    return emulate(q, k, v, cq, lengths, ck, block_table, window_size, softmax_scale)


FAKES = {"torch": fake_torch_kernel, "flash-attn": fake_flash_attn_kernel}


@pytest.fixture
def fake_kernel(monkeypatch):
    """Make find_kernel answer with an emulated kernel of the given name."""

    def use(name: str) -> None:
        monkeypatch.setattr(
            fv, "find_kernel", lambda device, kernel="auto": (name, FAKES[name], f"fake {name}")
        )

    return use


def test_window_convention():
    assert varlen_window(None) == (-1, 0)
    assert varlen_window(24) == (23, 0)
    assert varlen_window(1) == (0, 0)  # a window of one: each token sees itself only
    with pytest.raises(ValueError, match="sliding_window"):
        varlen_window(0)


def test_metadata_of_a_mixed_step():
    batch = packed_step(MIXED_STEP).batch
    q_lens = [q for _, q in MIXED_STEP]
    ctx = [p + q for p, q in MIXED_STEP]
    meta = build_varlen_metadata(batch, 24, paged=True)
    assert meta.cu_seqlens_q.tolist() == [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    assert meta.cu_seqlens_k.tolist() == [0, *torch.tensor(ctx).cumsum(0).tolist()]
    assert meta.seqused_k.tolist() == ctx
    assert (meta.max_seqlen_q, meta.max_seqlen_k) == (max(q_lens), max(ctx))
    for t in (meta.cu_seqlens_q, meta.cu_seqlens_k, meta.seqused_k, meta.block_table):
        assert t.dtype == torch.int32 and t.is_contiguous()
    assert torch.equal(meta.block_table, batch.block_tables)
    assert meta.kv_slots is None and meta.window == (23, 0)
    gathered = build_varlen_metadata(batch, None, paged=False)
    assert gathered.block_table is None and gathered.kv_slots.numel() == sum(ctx)
    assert gathered.window == (-1, 0)


@pytest.mark.parametrize("kernel", ["torch", "flash-attn"])
@pytest.mark.parametrize("paged", [True, False])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 2), (4, 4)])
def test_forward_with_emulated_kernel_matches_eager(
    fake_kernel, monkeypatch, kernel, paged, window, heads, kv_heads
):
    fake_kernel(kernel)
    monkeypatch.setattr(fv, "HALF_DTYPES", (torch.float32,))  # the emulator is exact in float32
    monkeypatch.setattr(fv, "PAGE_MULTIPLE", 4)
    step = packed_step(MIXED_STEP, num_heads=heads, num_kv_heads=kv_heads)
    eager = EagerBackend().forward(step.query, step.key, step.value, 0, step.batch, step.cache, SCALE, window)
    backend = FlashVarlenBackend(FlashVarlenBackend.Params(paged=paged))
    out = backend.forward(step.query, step.key, step.value, 0, step.batch, step.cache, SCALE, window)
    torch.testing.assert_close(out, eager, atol=2e-6, rtol=1e-5)


def test_unavailable_here_says_why():
    reason = FlashVarlenBackend.unavailable_reason(torch.device("cpu"))
    assert reason is not None and "CUDA" in reason
    with pytest.raises(BackendUnavailable, match=r"flash-varlen.*CUDA"):
        Engine(tiny_model("llama"), config=EngineConfig.model_validate({"backend": {"name": "flash-varlen"}}))


def test_check_refuses_what_the_kernels_cannot_run(fake_kernel):
    fake_kernel("torch")
    cpu = torch.device("cpu")
    backend = FlashVarlenBackend()
    with pytest.raises(BackendUnavailable, match=r"float16/bfloat16.*float32"):
        backend.check(cpu, 256, torch.float32)
    with pytest.raises(BackendUnavailable, match=r"multiple of 256.*block_size is 16"):
        backend.check(cpu, 16, torch.bfloat16)
    backend.check(cpu, 512, torch.bfloat16)
    FlashVarlenBackend(FlashVarlenBackend.Params(paged=False)).check(cpu, 16, torch.float16)
    with pytest.raises(ValueError, match="kernel"):
        FlashVarlenBackend.Params(kernel="triton")


def test_head_dim_must_suit_the_kernel(fake_kernel, monkeypatch):
    fake_kernel("torch")
    monkeypatch.setattr(fv, "HALF_DTYPES", (torch.float32,))
    step = packed_step([(3, 2)], head_dim=12)
    backend = FlashVarlenBackend(FlashVarlenBackend.Params(paged=False))
    with pytest.raises(BackendUnavailable, match=r"head_dim a multiple of 8.*12"):
        backend.forward(step.query, step.key, step.value, 0, step.batch, step.cache, SCALE, None)


def test_find_kernel_names_every_missing_piece(monkeypatch):
    fv.find_kernel.cache_clear()
    monkeypatch.setattr(fv, "_device_problem", lambda device: None)
    real_version = importlib.metadata.version

    def version(name):
        if name == "flash_attn":
            return "2.5.6"
        return real_version(name)

    monkeypatch.setattr(fv.importlib.metadata, "version", version)
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: False)
    try:
        name, fn, reason = fv.find_kernel(torch.device("cuda"))
        assert name is None and fn is None
        assert "2.5.6" in reason and ">= 2.5.7" in reason
        assert "without FlashAttention" in reason
        _, _, only_torch = fv.find_kernel(torch.device("cuda"), "torch")
        assert "flash_attn" not in only_torch
    finally:
        fv.find_kernel.cache_clear()


def test_an_older_torch_varlen_is_named(monkeypatch):
    import torch.nn.attention.varlen as varlen

    monkeypatch.setattr(
        varlen, "varlen_attn", lambda q, k, v, cu_q, cu_k, max_q, max_k, *, is_causal=False: q
    )
    fn, reason = fv._torch_kernel()
    assert fn is None and "lacks block_table, enable_gqa" in reason


def test_cpu_device_is_refused_before_probing():
    _, fn, reason = fv.find_kernel(torch.device("cpu"))
    assert fn is None and "use 'sdpa'" in reason


def test_version_parsing():
    assert fv._version_tuple("2.8.3.post1") == (2, 8, 3)
    assert fv._version_tuple("2.5.7+cu121torch2.3") == (2, 5, 7)
    assert fv._version_tuple("2.6") == (2, 6)


@pytest.fixture(scope="module")
def mistral_bf16():
    model = tiny_model("mistral", dtype=torch.bfloat16)
    return model, reference_generate(model, PROMPTS, CAPS, top_logprobs=5)


@pytest.mark.parametrize("paged", [True, False])
def test_engine_steps_through_the_emulated_kernel(fake_kernel, monkeypatch, mistral_bf16, paged):
    """Real engine steps (chunks, preemption, swap, a sliding window) drive the varlen arguments."""
    fake_kernel("torch")
    monkeypatch.setattr(fv, "PAGE_MULTIPLE", 4)  # the emulator reads any page size
    model, references = mistral_bf16
    mix = available_mixes()["priority+chunked+swap"]
    config = EngineConfig.model_validate({**mix, "backend": {"name": "flash-varlen", "paged": paged}})
    engine = Engine(model, config=config)
    params = [SamplingParams(max_new_tokens=c, logprobs=5) for c in CAPS]
    outputs = engine.generate(PROMPTS, params, priorities=PRIORITIES, client_ids=CLIENTS)
    assert_equivalent(compare_topk(outputs, references))
    assert engine.scheduler.num_preemptions > 0
    assert engine.step_totals.mixed_steps > 0


# -- on CUDA: the real kernels -------------------------------------------------------

cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or FlashVarlenBackend.unavailable_reason(torch.device("cuda")) is not None,
    reason="needs a CUDA device with a FlashAttention varlen kernel",
)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("paged", "block_size"), [(True, 256), (False, 4)])
@pytest.mark.parametrize("window", [None, 5])
def test_cuda_kernel_matches_eager(dtype, paged, block_size, window):
    ref = packed_step(MIXED_STEP, block_size=block_size, head_dim=64)
    eager = EagerBackend().forward(ref.query, ref.key, ref.value, 0, ref.batch, ref.cache, SCALE, window)
    step = packed_step(MIXED_STEP, block_size=block_size, head_dim=64, dtype=dtype, device="cuda")
    backend = FlashVarlenBackend(FlashVarlenBackend.Params(paged=paged))
    backend.check(torch.device("cuda"), block_size, dtype)
    out = backend.forward(step.query, step.key, step.value, 0, step.batch, step.cache, SCALE, window)
    torch.testing.assert_close(out.float().cpu(), eager, atol=3e-2, rtol=3e-2)


@functools.cache
def cuda_bf16_reference(family: str):
    model = tiny_model(family, dtype=torch.bfloat16).to("cuda")
    return model, reference_generate(model, PROMPTS, CAPS, top_logprobs=5)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("family", ["llama", "mistral"])
@pytest.mark.parametrize("paged", [True, False])
def test_cuda_engine_half_precision_top5(family, paged):
    model, references = cuda_bf16_reference(family)
    if paged:  # pages of 256 tokens; 4 of them hold 4 requests at a time
        setup = {"kv_cache": {"block_size": 256, "num_blocks": 4}}
    else:
        setup = available_mixes()["priority+chunked+swap"]
    config = EngineConfig.model_validate({**setup, "backend": {"name": "flash-varlen", "paged": paged}})
    engine = Engine(model, config=config)
    params = [SamplingParams(max_new_tokens=c, logprobs=5) for c in CAPS]
    outputs = engine.generate(PROMPTS, params, priorities=PRIORITIES, client_ids=CLIENTS)
    assert_equivalent(compare_topk(outputs, references))
    if not paged:
        assert engine.scheduler.num_preemptions > 0
