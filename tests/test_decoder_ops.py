"""The fused forward's C glue: the same numbers as HF's ops to rounding, in place where it says so."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cbcore import Engine, EngineConfig, SamplingParams
from cbcore.models.decoder_ops import NativeOps, TorchOps, native_refusal
from cbcore.models.fused_decoder import FusedDecoder
from cbcore.testing.tiny_models import random_prompts, tiny_model

needs_kernel = pytest.mark.skipif(
    native_refusal(tiny_model("llama"), 8) is not None, reason="decoder_ops.c cannot be built here"
)


class _Norm(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width))
        self.variance_epsilon = 1e-6


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 40])  # 40: split across threads
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_norm_matches_torch_and_adds_in_place(rows, with_delta):
    torch.manual_seed(rows)
    norm = _Norm(72)
    h, delta = torch.randn(rows, 72), torch.randn(rows, 72) if with_delta else None
    h_torch = h.clone()
    expected = TorchOps.add_norm(h_torch, delta, norm)
    got = NativeOps.add_norm(h, delta, norm)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h, h_torch, atol=0, rtol=0)  # the residual add is exact either way


@needs_kernel
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_rotary_matches_torch_in_place_on_a_strided_view(rows):
    torch.manual_seed(rows)
    heads, dim = 5, 16
    qkv = torch.randn(rows, heads * dim + 24)  # the v columns after q and k: rows are strided
    cos, sin = torch.randn(rows, dim), torch.randn(rows, dim)
    view = qkv[:, : heads * dim].view(rows, heads, dim)
    expected = TorchOps.rotate(view.clone(), cos, sin)
    tail = qkv[:, heads * dim :].clone()
    got = NativeOps.rotate(view, cos, sin)
    assert got.data_ptr() == qkv.data_ptr()
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
    assert torch.equal(qkv[:, heads * dim :], tail)  # v untouched


@needs_kernel
@pytest.mark.parametrize("rows", [1, 40])
def test_silu_mul_matches_torch(rows):
    gate_up = torch.randn(rows, 2 * 48) * 4
    torch.testing.assert_close(NativeOps.silu_mul(gate_up, nn.SiLU()), TorchOps.silu_mul(gate_up, nn.SiLU()))


@needs_kernel
def test_the_fused_forward_with_either_glue_gives_the_same_tokens():
    model = tiny_model("llama")
    config = EngineConfig.model_validate({"execution": {"linear": "standard"}})
    prompts = random_prompts(4, 3, 40, seed=7)
    outputs = {}
    for native in (True, False):
        engine = Engine(model, config=config)
        engine.runner.fused = FusedDecoder(model, onednn=False, native=native)
        assert engine.runner.fused.ops is (NativeOps if native else TorchOps)
        outputs[native] = [
            o.output_token_ids for o in engine.generate(prompts, SamplingParams(max_new_tokens=8))
        ]
    assert outputs[True] == outputs[False]


def test_what_the_kernel_does_not_cover_is_named():
    model = tiny_model("llama")
    assert "even head_dim" in native_refusal(model, 7)
    model.model.layers[0].mlp.act_fn = nn.GELU()
    assert "MLP uses GELU" in native_refusal(model, 8)
    assert "bfloat16" in native_refusal(tiny_model("llama").to(torch.bfloat16), 8)


@needs_kernel
def test_layouts_the_kernel_cannot_follow_are_refused_not_misread():
    norm = _Norm(8)
    with pytest.raises(ValueError, match="residual stream h must be contiguous"):
        NativeOps.add_norm(torch.randn(8, 4).t(), None, norm)
    with pytest.raises(ValueError, match="heads must be contiguous within a row"):
        NativeOps.rotate(torch.randn(3, 16, 2).transpose(1, 2), torch.randn(3, 16), torch.randn(3, 16))
    cos, sin = torch.randn(16, 3).t(), torch.randn(16, 3).t()  # strided [3, 16]: copied, not misread
    qk = torch.randn(3, 2, 16)
    torch.testing.assert_close(NativeOps.rotate(qk.clone(), cos, sin), TorchOps.rotate(qk, cos, sin))
