"""The compiled paged decode kernel: built once per machine, refuses what it cannot read, never guesses."""

from __future__ import annotations

import logging

import pytest
import torch
from support.attention_batches import packed_step

from cbcore.backends.eager import EagerBackend
from cbcore.backends.sdpa import SdpaBackend
from cbcore.execution.backend import BackendUnavailable
from cbcore.kernels import native, paged_decode

SCALE = 0.125


@pytest.fixture
def fresh_kernel(monkeypatch, tmp_path):
    """A process that has not loaded the kernel yet, with its own cache directory."""
    monkeypatch.setenv("CBCORE_CACHE_DIR", str(tmp_path))
    paged_decode.KERNEL.forget()
    yield tmp_path
    paged_decode.KERNEL.forget()


def pool_and_rows(rows=2, blocks=6, block_size=4, heads=4, kv_heads=2, head_dim=8):
    torch.manual_seed(0)
    k = torch.randn(blocks * block_size, kv_heads, head_dim)
    v = torch.randn(blocks * block_size, kv_heads, head_dim)
    q = torch.randn(rows, heads, head_dim)
    tables = torch.arange(rows * 3, dtype=torch.int32).view(rows, 3)
    starts = torch.zeros(rows, dtype=torch.long)
    counts = torch.full((rows,), 10, dtype=torch.long)
    return q, k, v, tables, starts, counts


def test_built_on_first_use_then_loaded_from_the_cache(fresh_kernel):
    assert paged_decode.unavailable_reason() is None
    origin = paged_decode.KERNEL.load()[1]
    assert origin.startswith(("built ", "cached "))  # cached: built a moment ago, to time the instruction sets
    (library,) = [p for p in (fresh_kernel / "kernels").glob("paged_decode-*.so") if str(p) in origin]
    paged_decode.KERNEL.forget()
    assert paged_decode.KERNEL.load()[1] == f"cached {library}"


@pytest.mark.parametrize(
    ("change", "what"),
    [
        (lambda t, s, c: t.__setitem__((1, 2), 99), "block 99 of a 6-block pool"),
        (lambda t, s, c: t.__setitem__((0, 0), -1), "a negative block"),
        (lambda t, s, c: c.__setitem__(1, 13), "positions past the row's table"),
        (lambda t, s, c: s.__setitem__(0, -1), "a negative start"),
        (lambda t, s, c: c.__setitem__(0, 0), "a row with no key"),
    ],
)
def test_rows_outside_the_table_or_pool_are_refused_before_reading(change, what):
    q, k, v, tables, starts, counts = pool_and_rows()
    change(tables, starts, counts)
    with pytest.raises(ValueError, match="outside its block table or the pool"):
        paged_decode.paged_decode(q, k, v, paged_decode.PagedRows(tables, starts, counts, 4), SCALE)


def test_tensors_it_cannot_read_are_named():
    q, k, v, tables, starts, counts = pool_and_rows()
    with pytest.raises(ValueError, match=r"tables must be a contiguous CPU torch\.int32"):
        paged_decode.PagedRows(tables.long(), starts, counts, 4)
    with pytest.raises(
        ValueError, match=r"query must be a contiguous CPU torch\.float32 tensor, got non-contiguous"
    ):
        paged_decode.paged_decode(q.transpose(0, 1), k, v, paged_decode.PagedRows(tables, starts, counts, 4), SCALE)
    with pytest.raises(ValueError, match="not made of blocks of 5"):
        paged_decode.paged_decode(q, k, v, paged_decode.PagedRows(tables, starts, counts, 5), SCALE)
    with pytest.raises(ValueError, match="does not fit the pool"):
        paged_decode.paged_decode(q[:, :3].contiguous(), k, v, paged_decode.PagedRows(tables, starts, counts, 4), SCALE)


def test_no_compiler_gathers_with_a_warning_or_refuses_when_paged_was_asked(
    fresh_kernel, monkeypatch, caplog
):
    monkeypatch.setenv("CC", "no-such-cc")
    assert "no C compiler found ('no-such-cc'" in paged_decode.unavailable_reason()
    with pytest.raises(BackendUnavailable, match="decode='paged': no C compiler found"):
        SdpaBackend(SdpaBackend.Params(decode="paged")).check(torch.device("cpu"), 16, torch.float32)
    step = packed_step([(12, 1), (3, 1)])
    backend = SdpaBackend()
    with caplog.at_level(logging.WARNING):
        fast = backend.forward(step.query, step.key, step.value, 0, step.batch, step.cache, SCALE, None)
    assert "paged CPU kernel is unavailable" in caplog.text
    eager = EagerBackend().forward(step.query, step.key, step.value, 0, step.batch, step.cache, SCALE, None)
    torch.testing.assert_close(fast, eager, atol=2e-6, rtol=1e-5)


def test_a_failed_build_says_why(fresh_kernel, monkeypatch):
    monkeypatch.setenv("CC", "false")
    reason = paged_decode.unavailable_reason()
    assert "could not build paged_decode.c (exit 1)" in reason
    assert not list((fresh_kernel / "kernels").glob("*.so"))  # no half-written library left behind


def test_paged_refuses_a_setup_it_does_not_run():
    with pytest.raises(BackendUnavailable, match=r"runs on the CPU in float32, the model is torch\.bfloat16"):
        SdpaBackend(SdpaBackend.Params(decode="paged")).check(torch.device("cpu"), 16, torch.bfloat16)


@pytest.mark.parametrize("spread", [1.0, 40.0])  # 40: most weights underflow beside the largest
def test_paged_decode_matches_a_plain_softmax_at_any_score_spread(spread):
    """Scores far below a row's largest go to zero, as a float softmax gives them; the rest match."""
    torch.manual_seed(1)
    heads, kv_heads, head_dim, block_size, n = 6, 2, 64, 16, 45  # 45: a partial block and a tail of keys
    k = torch.randn(4 * block_size, kv_heads, head_dim)
    v = torch.randn(4 * block_size, kv_heads, head_dim)
    q = torch.randn(1, heads, head_dim) * spread
    tables = torch.tensor([[2, 0, 3]], dtype=torch.int32)
    rows = paged_decode.PagedRows(tables, torch.zeros(1, dtype=torch.long), torch.tensor([n]), block_size)
    got = paged_decode.paged_decode(q, k, v, rows, SCALE)
    slots = (tables[0].long()[:, None] * block_size + torch.arange(block_size)).reshape(-1)[:n]
    keys = k[slots].repeat_interleave(heads // kv_heads, dim=1)  # [n, heads, D]
    values = v[slots].repeat_interleave(heads // kv_heads, dim=1)
    weights = (torch.einsum("hd,nhd->hn", q[0].double(), keys.double()) * SCALE).softmax(-1)
    expected = torch.einsum("hn,nhd->hd", weights, values.double()).float()
    torch.testing.assert_close(got[0], expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("rows", [1, 3, 7, 40])  # fewer rows than twice the threads: units are (row, KV head)
def test_every_row_is_computed_once_and_alike_whatever_the_threads(rows, monkeypatch):
    """Threads split the rows by their keys (so each knows what it reads next): every row is
    computed, by exactly the instructions of one thread alone, for any thread count."""
    torch.manual_seed(rows)
    heads, kv_heads, head_dim, block_size = 6, 2, 64, 16
    counts = torch.randint(1, 70, (rows,))
    counts[0] = 70  # one long row beside short ones: uneven shares
    tables = torch.randperm(rows * 5).view(rows, 5).to(torch.int32)
    k = torch.randn(rows * 5 * block_size, kv_heads, head_dim)
    v = torch.randn(rows * 5 * block_size, kv_heads, head_dim)
    q = torch.randn(rows, heads, head_dim)
    keys = paged_decode.PagedRows(tables, torch.zeros(rows, dtype=torch.long), counts, block_size)
    outs = {}
    for threads in (1, 2, 3, 5):
        monkeypatch.setattr(torch, "get_num_threads", lambda threads=threads: threads)
        outs[threads] = paged_decode.paged_decode(q, k, v, keys, SCALE)
    assert all(torch.equal(outs[1], out) for out in outs.values())
    for row in range(rows):
        slots = (tables[row].long()[:, None] * block_size + torch.arange(block_size)).reshape(-1)[: counts[row]]
        keys_, values = (t[slots].repeat_interleave(heads // kv_heads, dim=1).double() for t in (k, v))
        weights = (torch.einsum("hd,nhd->hn", q[row].double(), keys_) * SCALE).softmax(-1)
        torch.testing.assert_close(outs[1][row], torch.einsum("hn,nhd->hd", weights, values).float(), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("isa", native.supported_isas())
@pytest.mark.parametrize("head_dim", [64, 24, 20])  # 24: AVX2's vectors, not AVX-512's; 20: plain loops only
def test_every_instruction_set_this_cpu_runs_matches_a_plain_softmax(isa, head_dim, fresh_kernel, monkeypatch):
    """Each build ``$CBCORE_KERNEL_ISA`` forces is the one loaded, and computes the same attention:
    runs of every length (tails of a 16- and an 8-key chunk), a row whose largest score comes late."""
    monkeypatch.setenv(native.ISA_ENV, isa)
    torch.manual_seed(2)
    heads, kv_heads, block_size, rows = 6, 2, 16, 5
    counts = torch.tensor([1, 7, 16, 45, 70])
    tables = torch.randperm(rows * 5).view(rows, 5).to(torch.int32)
    k = torch.randn(rows * 5 * block_size, kv_heads, head_dim)
    v = torch.randn(rows * 5 * block_size, kv_heads, head_dim)
    q = torch.randn(rows, heads, head_dim) * 4
    k[tables[4, 4].long() * block_size + 3] *= 8  # row 4's largest scores at position 67: rescales all before it
    keys = paged_decode.PagedRows(tables, torch.zeros(rows, dtype=torch.long), counts, block_size)
    got = paged_decode.paged_decode(q, k, v, keys, SCALE)
    assert f"paged_decode-{isa}-" in paged_decode.KERNEL.load()[1]
    for row in range(rows):
        slots = (tables[row].long()[:, None] * block_size + torch.arange(block_size)).reshape(-1)[: counts[row]]
        keys_, values = (t[slots].repeat_interleave(heads // kv_heads, dim=1).double() for t in (k, v))
        weights = (torch.einsum("hd,nhd->hn", q[row].double(), keys_) * SCALE).softmax(-1)
        torch.testing.assert_close(got[row], torch.einsum("hn,nhd->hd", weights, values).float(), atol=2e-5, rtol=1e-4)


def test_an_instruction_set_that_is_not_one_or_not_here_is_named(fresh_kernel, monkeypatch):
    monkeypatch.setenv(native.ISA_ENV, "avx1024")
    with pytest.raises(ValueError, match=r"CBCORE_KERNEL_ISA='avx1024': expected auto or one of avx512, avx2, plain"):
        paged_decode.unavailable_reason()
    missing = [isa for isa in native.ISAS if isa not in native.supported_isas()]
    for isa in missing:  # on a CPU without AVX-512 (or AVX2): forcing it is refused, never quietly narrowed
        monkeypatch.setenv(native.ISA_ENV, isa)
        paged_decode.KERNEL.forget()
        with pytest.raises(ValueError, match=f"CBCORE_KERNEL_ISA={isa}: this CPU lacks"):
            paged_decode.unavailable_reason()
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx2", "fma"}))  # an AVX2-only CPU
    assert native.supported_isas() == ["avx2", "plain"]
    monkeypatch.setenv(native.ISA_ENV, "avx512")
    paged_decode.KERNEL.forget()
    with pytest.raises(ValueError, match="this CPU lacks avx512dq, avx512f"):
        paged_decode.unavailable_reason()
