"""silu_mul kernel vs the fp64 reference: dtypes, odd widths, strided rows."""

import pytest
import torch

from kernels.activation import silu_mul
from kernels.reference import silu_mul_reference
from tests.utils import assert_close

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize(
    "tokens, inter",
    [(1, 64), (3, 145), (5, 123), (2, 2065)],
    ids=["1x64", "3x145", "5x123", "2x2065"],
)
def test_silu_mul_matches_reference(tokens, inter, dtype):
    gen = torch.Generator().manual_seed(tokens * inter)
    x = (2 * torch.randn(tokens, 2 * inter, generator=gen)).to(dtype)
    out = silu_mul(x)
    assert out.shape == (tokens, inter) and out.dtype == dtype
    assert_close(out, silu_mul_reference(x.double()), dtype)


def test_silu_mul_strided_rows():
    gen = torch.Generator().manual_seed(7)
    wide = torch.randn(4, 2 * 40 + 8, generator=gen)
    x = wide[:, 8:]  # row stride 88, contiguous last dim
    assert_close(silu_mul(x), silu_mul_reference(x.double()), torch.float32)


@pytest.mark.parametrize(
    "x",
    [
        torch.randn(3, 7),
        torch.randn(3, 8).t(),
        torch.randn(2, 3, 8),
        torch.ones(2, 8, dtype=torch.int32),
    ],
    ids=["odd-width", "strided-last-dim", "3d", "int"],
)
def test_silu_mul_bad_input_names_x(x):
    with pytest.raises(ValueError, match="^x"):
        silu_mul(x)
