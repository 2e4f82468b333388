"""cbcore's few-rows linear kernel: the numbers of F.linear, whatever rows sit beside a row."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cbcore.execution import skinny_linear
from cbcore.execution.skinny_linear import skinny_linear as product

pytestmark = pytest.mark.skipif(
    skinny_linear.unavailable_reason() is not None, reason=f"kernel unavailable: {skinny_linear.unavailable_reason()}"
)

# in x out: multiples of the kernel's 8 lanes and 4 weight rows, and not; one weight row; the model's shapes
SHAPES = [(32, 48), (13, 7), (1, 1), (9, 5), (576, 192), (1536, 576)]


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 17])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{i}x{o}" for i, o in SHAPES])
def test_matches_f_linear(threads, rows, bias, shape):
    in_features, out_features = shape
    gen = torch.Generator().manual_seed(rows * 1000 + in_features)
    w = torch.randn(out_features, in_features, generator=gen) / in_features**0.5
    b = torch.randn(out_features, generator=gen) if bias else None
    x = torch.randn(rows, in_features, generator=gen)
    torch.testing.assert_close(product(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{i}x{o}" for i, o in SHAPES])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(threads, shape):
    """Bitwise: a decode row gets the same logits alone or in a batch of 11 (odd, so both tile kinds run)."""
    in_features, out_features = shape
    gen = torch.Generator().manual_seed(in_features)
    w, b = torch.randn(out_features, in_features, generator=gen), torch.randn(out_features, generator=gen)
    x = torch.randn(11, in_features, generator=gen)
    together = product(x, w, b)
    alone = torch.cat([product(x[r : r + 1], w, b) for r in range(11)])
    pairs = torch.cat([product(x[r : r + 2], w, b) for r in range(0, 10, 2)] + [product(x[10:], w, b)])
    assert torch.equal(together, alone) and torch.equal(together, pairs)


def test_any_leading_shape_and_non_contiguous_inputs():
    w = torch.randn(6, 10)
    x = torch.randn(10, 2, 3).permute(1, 2, 0)  # [2, 3, 10], not contiguous
    out = product(x, w, None)
    assert out.shape == (2, 3, 6)
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert product(torch.randn(0, 10), w, None).shape == (0, 6)


def test_inputs_it_cannot_read_are_named():
    w = torch.randn(6, 10)
    with pytest.raises(ValueError, match="weight must be a contiguous 2-D CPU float32"):
        product(torch.randn(2, 10), w.t().contiguous().t(), None)
    with pytest.raises(ValueError, match=r"weight must be .* got \(6, 10\) torch.bfloat16"):
        product(torch.randn(2, 10), w.bfloat16(), None)
    with pytest.raises(ValueError, match=r"input must be a CPU float32 tensor \[\.\.\., 10\], got \(2, 9\)"):
        product(torch.randn(2, 9), w, None)
    with pytest.raises(ValueError, match=r"input must be .* torch\.float64"):
        product(torch.randn(2, 10, dtype=torch.float64), w, None)
    with pytest.raises(ValueError, match=r"bias must be a contiguous CPU float32 \[6\], got \(5,\)"):
        product(torch.randn(2, 10), w, torch.randn(5))
