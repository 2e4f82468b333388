"""The CPU kernel for whole prompts: every prompt of a step in one call, each as SDPA computes it alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.attention_batches import packed_step, torch_threads

from cbcore.backends.sdpa import SdpaBackend
from cbcore.kernels.prompt_attention import Prompts, prompt_attention

SCALE = 0.125


def step_tensors(lens, heads, kv_heads, dim, layout):
    """q/k/v of ``sum(lens)`` rows laid out as the fused forward leaves them (``joined``: views of one
    product's rows) or as transformers' modules do (``heads-major``: [heads, T, D] transposed)."""
    torch.manual_seed(sum(lens) + heads + dim)
    rows = sum(lens)
    if layout == "joined":
        qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim)
        q = qkv[:, : heads * dim].view(rows, heads, dim)
        k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(rows, kv_heads, dim)
        return q, k, qkv[:, (heads + kv_heads) * dim :].view(rows, kv_heads, dim)
    return tuple(torch.randn(n, rows, dim).transpose(0, 1) for n in (heads, kv_heads, kv_heads))


def alone(q, k, v, start, n):
    rows = slice(start, start + n)
    sdpa = F.scaled_dot_product_attention(
        *(t[rows].transpose(0, 1)[None] for t in (q, k, v)), is_causal=True, scale=SCALE, enable_gqa=True
    )
    return sdpa[0].transpose(0, 1)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "layout"),
    [
        (9, 3, 64, "joined"), (8, 4, 64, "heads-major"), (4, 4, 64, "joined"), (8, 2, 16, "joined"),
        (6, 2, 12, "heads-major"), (16, 2, 128, "heads-major"),
    ],
)
def test_each_prompt_gets_what_sdpa_gives_it_alone(threads, heads, kv_heads, dim, layout):
    lens = [37, 200, 2, 64, 129, 16, 17, 3]
    q, k, v = step_tensors(lens, heads, kv_heads, dim, layout)
    starts = [sum(lens[:i]) for i in range(len(lens))]
    out = torch.full(q.shape, 7.0)
    with torch_threads(threads):
        prompt_attention(q, k, v, out, Prompts.of(list(zip(starts, lens, strict=True))[1:], sum(lens)), SCALE)
    assert torch.equal(out[: lens[0]], torch.full((lens[0], heads, dim), 7.0))  # not a prompt of the call: untouched
    for start, n in list(zip(starts, lens, strict=True))[1:]:
        torch.testing.assert_close(out[start : start + n], alone(q, k, v, start, n), atol=2e-6, rtol=1e-5)


def test_what_the_kernel_cannot_read_is_refused_before_it_runs():
    q, k, v = step_tensors([4, 4], 4, 2, 16, "joined")
    out = torch.empty(q.shape)
    with pytest.raises(ValueError, match="outside the step's 8 rows"):
        Prompts.of([(0, 4), (6, 4)], 8)
    with pytest.raises(ValueError, match="placed among 9 rows"):
        prompt_attention(q, k, v, out, Prompts.of([(0, 4)], 9), SCALE)
    with pytest.raises(ValueError, match="query must be float32"):
        prompt_attention(q.double(), k, v, out, Prompts.of([(0, 4)], 8), SCALE)
    with pytest.raises(ValueError, match="3 query heads cannot share 2 KV heads"):
        prompt_attention(q[:, :3], k, v, out[:, :3].contiguous(), Prompts.of([(0, 4)], 8), SCALE)


def test_the_paged_plan_sends_whole_unwindowed_prompts_to_the_kernel():
    step = packed_step([(0, 6), (3, 1), (0, 5), (4, 3), (0, 9)])
    paged = SdpaBackend.plan(step.batch, None, torch.float32, paged=True)
    assert paged.prompts.starts.tolist() == [0, 7, 15] and paged.prompts.lens.tolist() == [6, 5, 9]
    assert [(s.q_start, s.q_end) for s in paged.spans] == [(12, 15)]  # the chunk after context keeps its mask
    gathered = SdpaBackend.plan(step.batch, None, torch.float32, paged=False)
    assert gathered.prompts is None and len(gathered.spans) == 4
    windowed = SdpaBackend.plan(step.batch, 6, torch.float32, paged=True)  # a window cuts the 9-token prompt
    assert windowed.prompts.lens.tolist() == [6, 5] and [s.q_end - s.q_start for s in windowed.spans] == [3, 9]
