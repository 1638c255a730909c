"""RMSNorm kernel vs the fp64 reference: dtypes, odd widths, fused residual, strided heads."""

import pytest
import torch

from kernels.norm import RmsNormConfig, rmsnorm
from kernels.reference import rmsnorm_reference
from kernels.utils import is_interpreter
from tests.utils import assert_close

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(1, 64), (3, 145), (5, 123)]  # 2^7 + 17, 123: masked tails


def _inputs(shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(dtype)
    residual = torch.randn(shape, generator=gen).to(dtype)
    return x, weight, residual


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_rmsnorm_matches_reference(shape, dtype):
    x, weight, _ = _inputs(shape, dtype)
    out = rmsnorm(x, weight, 1e-6)
    expected = rmsnorm_reference(x.double(), weight.double(), 1e-6)
    assert out.dtype == dtype and out.shape == x.shape
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_rmsnorm_fused_residual(dtype):
    x, weight, residual = _inputs((4, 145), dtype, seed=1)
    out, new_residual = rmsnorm(x, weight, 1e-5, residual)
    if dtype == torch.bfloat16 and is_interpreter():
        # The interpreter casts fp32 -> bf16 by truncation (GPUs round to nearest even).
        assert_close(new_residual, x.double() + residual.double(), dtype)
    else:
        # The residual sum is rounded to the input dtype, exactly as the reference adds.
        assert torch.equal(new_residual, x + residual)
    expected, _ = rmsnorm_reference(x.double(), weight.double(), 1e-5, residual.double())
    assert_close(out, expected, dtype)


def test_rmsnorm_per_head_strided_view():
    """Qwen3 q/k norm: a [T, heads, D] view into the fused qkv output, normalised per head."""
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(3, (4 + 2 + 2) * 16, generator=gen)
    q = qkv[:, : 4 * 16].view(3, 4, 16)
    k = qkv[:, 4 * 16 : 6 * 16].view(3, 2, 16)
    weight = torch.randn(16, generator=gen)
    for t in (q, k):
        assert_close(
            rmsnorm(t, weight, 1e-6),
            rmsnorm_reference(t.double(), weight.double(), 1e-6),
            torch.float32,
        )


def test_rmsnorm_tiled_sweep_matches_reference():
    """A row wider than the tile (the two-sweep path) is still correct."""
    x, weight, residual = _inputs((3, 145), torch.float32, seed=3)
    out, _ = rmsnorm(x, weight, 1e-6, residual, config=RmsNormConfig(BLOCK_SIZE=32, num_warps=1))
    expected, _ = rmsnorm_reference(x.double(), weight.double(), 1e-6, residual.double())
    assert_close(out, expected, torch.float32)


@pytest.mark.parametrize(
    "case, name",
    [
        (lambda x, w, r: rmsnorm(x, w[:-1], 1e-6), "weight"),
        (lambda x, w, r: rmsnorm(x, w.half(), 1e-6), "weight"),
        (lambda x, w, r: rmsnorm(x, w, -1.0), "eps"),
        (lambda x, w, r: rmsnorm(x, w, 1e-6, r[:, :-1]), "residual"),
        (lambda x, w, r: rmsnorm(x.t(), w[:4], 1e-6), "x"),
        (lambda x, w, r: rmsnorm(x.long(), w, 1e-6), "x"),
    ],
    ids=["weight-shape", "weight-dtype", "eps", "residual-shape", "x-stride", "x-dtype"],
)
def test_rmsnorm_bad_input_names_argument(case, name):
    x, weight, residual = _inputs((4, 32), torch.float32)
    with pytest.raises(ValueError, match=f"^{name}"):
        case(x, weight, residual)


def test_rmsnorm_policy_packs_narrow_fp32_rows_only():
    """16 rows a program for fp32 rows that fit a 256 tile (the interpreter pays per program);
    one row a program for the GPU's half-precision dtypes and for wide rows."""
    from kernels.norm import rmsnorm_config

    assert rmsnorm_config(128, torch.float32).ROWS == 16
    assert rmsnorm_config(128, torch.bfloat16).ROWS == 1
    assert rmsnorm_config(128, torch.float16).ROWS == 1
    assert rmsnorm_config(4096, torch.float32).ROWS == 1


@pytest.mark.parametrize("rows", [1, 4])
def test_rmsnorm_rows_per_program_matches_reference(rows):
    """Several rows a program, on strided heads with a residual and a row count that leaves the
    last program part empty, is the reference's result and (fp32 sums per row) the one-row
    config's, whatever rows share a program."""
    x, weight, residual = _inputs((7, 3, 24), torch.float32, seed=3)
    packed = RmsNormConfig(BLOCK_SIZE=32, num_warps=1, ROWS=rows)
    out, new_residual = rmsnorm(x, weight, 1e-6, residual, config=packed)
    h = x.double() + residual.double()
    assert_close(out, rmsnorm_reference(h, weight.double(), 1e-6), torch.float32)
    assert_close(new_residual, h, torch.float32)
    shifted = rmsnorm(x[1:], weight, 1e-6, config=packed)  # every row moves within its program
    assert torch.equal(shifted, rmsnorm(x, weight, 1e-6, config=packed)[1:])


def test_rmsnorm_rows_per_program_needs_one_tile_rows():
    x, weight, _ = _inputs((2, 64), torch.float32)
    with pytest.raises(ValueError, match="^config"):
        rmsnorm(x, weight, 1e-6, config=RmsNormConfig(BLOCK_SIZE=32, num_warps=1, ROWS=4))
    with pytest.raises(ValueError, match="^ROWS"):
        RmsNormConfig(BLOCK_SIZE=32, num_warps=1, ROWS=3)
