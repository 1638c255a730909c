"""One comparison helper for kernel tests: dtype tolerance table, atol scaled by reduction length,
and a readable report of the first mismatches on failure."""

from __future__ import annotations

import math

import torch

# rtol and base atol per dtype; atol grows with sqrt(reduction length) (FlagGems' scaling).
TOLERANCE = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1.6e-2, 1e-2),
}


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    dtype: torch.dtype | None = None,
    reduce_dim: int = 1,
    atol: float | None = None,
    rtol: float | None = None,
) -> None:
    """Compare ``actual`` to a (usually fp64) ``expected`` with the tolerance of ``dtype``."""
    dtype = dtype or actual.dtype
    base_rtol, base_atol = TOLERANCE[dtype]
    rtol = base_rtol if rtol is None else rtol
    atol = base_atol * max(1.0, math.sqrt(reduce_dim)) if atol is None else atol
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    if a.shape != e.shape:
        raise AssertionError(f"shape {tuple(a.shape)} != expected {tuple(e.shape)}")
    bad = ~torch.isclose(a, e, rtol=rtol, atol=atol, equal_nan=False)
    if bad.any():
        idx = bad.nonzero()[:5].tolist()
        worst = (a - e).abs().max().item()
        lines = [
            f"  at {i}: got {a[tuple(i)].item():.6g}, expected {e[tuple(i)].item():.6g}"
            for i in idx
        ]
        raise AssertionError(
            f"{int(bad.sum())} of {bad.numel()} elements differ (dtype {dtype}, rtol {rtol}, "
            f"atol {atol:.3g}, max |diff| {worst:.3g}); first:\n" + "\n".join(lines)
        )


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Invariance checks compare bits, never with a tolerance."""
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        raise AssertionError(
            f"{what}: {actual.shape}/{actual.dtype} vs {expected.shape}/{expected.dtype}"
        )
    a, e = actual.detach().cpu(), expected.detach().cpu()
    if a.is_floating_point():
        a, e = a.contiguous().view(_int_view(a.dtype)), e.contiguous().view(_int_view(e.dtype))
    diff = a != e
    if diff.any():
        idx = diff.nonzero()[:5].tolist()
        raise AssertionError(
            f"{what}: {int(diff.sum())} of {diff.numel()} elements differ; first at {idx}"
        )


def _int_view(dtype: torch.dtype) -> torch.dtype:
    return {
        torch.float64: torch.int64,
        torch.float32: torch.int32,
        torch.float16: torch.int16,
        torch.bfloat16: torch.int16,
    }[dtype]
