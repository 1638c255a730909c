"""Gated-MLP activation: ``silu_mul(x [T, 2I]) = silu(x[:, :I]) * x[:, I:]`` -> [T, I].

The gate/up halves come from one fused gate_up GEMM (gate columns first). The math runs in fp32
and rounds once to the input dtype, as ``silu_mul_reference``.

Invariance: elementwise, no reduction; programs tile (token, column block) and the config reads
only I. A row's bits depend only on that row under every mode: position- and batch-invariant in
``default``, ``batch_invariant`` and ``corun``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.mode import Mode
from kernels.utils import FLOAT_DTYPES, check_tensor, next_power_of_2


@triton.jit
def _silu_mul_kernel(
    # pointers
    x_ptr,
    out_ptr,
    # sizes
    n_inter,
    # strides
    stride_x_t,
    stride_out_t,
    # meta
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = cols < n_inter
    x_row = x_ptr + token * stride_x_t
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + n_inter + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + token * stride_out_t + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class SiluMulConfig:
    """Output columns per program and warps per program."""

    BLOCK_SIZE: int
    num_warps: int


def silu_mul_config(
    intermediate_size: int, dtype: torch.dtype, mode: Mode = Mode.CORUN
) -> SiluMulConfig:
    """Pure policy of I only (never the number of tokens); identical for every mode, since an
    elementwise op gives the same bits under any tiling."""
    del dtype, mode
    block = min(next_power_of_2(intermediate_size), 2048)
    return SiluMulConfig(BLOCK_SIZE=block, num_warps=4 if block <= 1024 else 8)


def silu_mul(x: torch.Tensor, *, mode: Mode = Mode.CORUN) -> torch.Tensor:
    """silu(gate) * up for x [T, 2I] (contiguous last dim) -> new contiguous [T, I], x.dtype.

    Position- and batch-invariant under every mode.
    """
    mode = Mode.parse(mode)
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    num_tokens, width = x.shape
    if width % 2:
        raise ValueError(f"x: last dim must be 2 * intermediate size (even), got {width}")
    inter = width // 2
    out = torch.empty((num_tokens, inter), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    cfg = silu_mul_config(inter, x.dtype, mode)
    grid = (num_tokens, triton.cdiv(inter, cfg.BLOCK_SIZE))
    _silu_mul_kernel[grid](
        x,
        out,
        inter,
        x.stride(0),
        out.stride(0),
        BLOCK_SIZE=cfg.BLOCK_SIZE,
        num_warps=cfg.num_warps,
    )
    return out
