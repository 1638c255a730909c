"""RMSNorm over the last dim, with an optional fused residual add.

``rmsnorm(x [..., H], weight [H], eps)`` computes ``weight * (x * rsqrt(mean(x^2) + eps))`` with the
statistics in fp32 and the weight multiply in the input dtype after casting the normed row back, as
transformers' Qwen3/DeepSeek-V3 RMSNorm does. With ``residual``, ``h = x + residual`` is rounded to
the input dtype first (as the HF decoder layer adds) and the launcher returns ``(rmsnorm(h), h)``.

Rows may be strided (the Qwen3 per-head q/k norm passes a ``[T, heads, head_dim]`` view of the fused
qkv output); only the last dim must be contiguous.

Invariance: a program normalises one row (or, for narrow fp32 rows, 16 rows each reduced alone),
and the config reads only the row width ``H`` and the dtype, never the number of rows. A row's
bits therefore depend only on its own data under every mode: position-invariant *and*
batch-invariant in ``default``, ``batch_invariant`` and ``corun`` alike (there is no Liger-style
``n_rows`` switch to constrain).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.mode import Mode
from kernels.utils import (
    FLOAT_DTYPES,
    check_same_device,
    check_shape,
    check_tensor,
    next_power_of_2,
)


# n_rows only masks the multi-row path: unspecialised, so a varying row count compiles nothing.
@triton.jit(do_not_specialize=["n_rows"])
def _rmsnorm_kernel(
    # pointers
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    new_residual_ptr,
    # sizes
    n_inner,
    n_cols,
    eps,
    # strides (rows are addressed as [outer, inner] so strided [T, heads, D] views need no copy)
    stride_x_outer,
    stride_x_inner,
    stride_r_outer,
    stride_r_inner,
    stride_o_outer,
    stride_o_inner,
    stride_nr_outer,
    stride_nr_inner,
    # meta
    n_rows,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_BLOCKS: tl.constexpr,
    ROWS: tl.constexpr,
):
    if ROWS > 1:  # several one-tile rows a program, each reduced alone along its own axis
        _rmsnorm_rows(x_ptr, residual_ptr, weight_ptr, out_ptr, new_residual_ptr, n_inner,
                      n_cols, eps, stride_x_outer, stride_x_inner, stride_r_outer,
                      stride_r_inner, stride_o_outer, stride_o_inner, stride_nr_outer,
                      stride_nr_inner, n_rows, HAS_RESIDUAL, BLOCK_SIZE, ROWS)
        return
    row = tl.program_id(0).to(tl.int64)
    outer, inner = row // n_inner, row % n_inner
    x_row = x_ptr + outer * stride_x_outer + inner * stride_x_inner
    r_row = residual_ptr + outer * stride_r_outer + inner * stride_r_inner
    o_row = out_ptr + outer * stride_o_outer + inner * stride_o_inner
    nr_row = new_residual_ptr + outer * stride_nr_outer + inner * stride_nr_inner
    offs = tl.arange(0, BLOCK_SIZE)

    if NUM_BLOCKS == 1:
        # The whole row fits one tile: a single read, the sum of squares is one tl.sum tree.
        mask = offs < n_cols
        h = tl.load(x_row + offs, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            # Round the sum to the input dtype first: the reference (and HF) adds in that dtype.
            h = h.to(tl.float32) + tl.load(r_row + offs, mask=mask, other=0.0).to(tl.float32)
            h = h.to(x_ptr.dtype.element_ty)
            tl.store(nr_row + offs, h, mask=mask)
        h32 = h.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(h32 * h32, axis=0) / n_cols + eps)
        w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
        normed = (h32 * rstd).to(x_ptr.dtype.element_ty)
        tl.store(
            o_row + offs,
            (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty),
            mask=mask,
        )
    else:
        # Wide rows: accumulate squares tile by tile into a BLOCK_SIZE vector, reduce once at the
        # end (a fixed order for a fixed H), then a second sweep normalises.
        acc = tl.zeros([BLOCK_SIZE], dtype=tl.float32)
        for b in tl.static_range(NUM_BLOCKS):
            cols = b * BLOCK_SIZE + offs
            mask = cols < n_cols
            h = tl.load(x_row + cols, mask=mask, other=0.0)
            if HAS_RESIDUAL:
                h = h.to(tl.float32) + tl.load(r_row + cols, mask=mask, other=0.0).to(tl.float32)
                h = h.to(x_ptr.dtype.element_ty)
                tl.store(nr_row + cols, h, mask=mask)
            h32 = h.to(tl.float32)
            acc += h32 * h32
        rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / n_cols + eps)
        for b in tl.static_range(NUM_BLOCKS):
            cols = b * BLOCK_SIZE + offs
            mask = cols < n_cols
            if HAS_RESIDUAL:
                h = tl.load(nr_row + cols, mask=mask, other=0.0)
            else:
                h = tl.load(x_row + cols, mask=mask, other=0.0)
            w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
            normed = (h.to(tl.float32) * rstd).to(x_ptr.dtype.element_ty)
            out = (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty)
            tl.store(o_row + cols, out, mask=mask)


@triton.jit
def _rmsnorm_rows(
    x_ptr, residual_ptr, weight_ptr, out_ptr, new_residual_ptr, n_inner, n_cols, eps,
    stride_x_outer, stride_x_inner, stride_r_outer, stride_r_inner, stride_o_outer,
    stride_o_inner, stride_nr_outer, stride_nr_inner, n_rows,
    HAS_RESIDUAL: tl.constexpr, BLOCK_SIZE: tl.constexpr, ROWS: tl.constexpr,
):
    """ROWS rows of one tile each: the single-tile path of ``_rmsnorm_kernel`` on a [ROWS,
    BLOCK_SIZE] tile, every row's sum of squares its own reduction along axis 1."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    outer, inner = rows // n_inner, rows % n_inner
    offs = tl.arange(0, BLOCK_SIZE)
    mask = (rows < n_rows)[:, None] & (offs < n_cols)[None, :]
    x_rows = x_ptr + (outer * stride_x_outer + inner * stride_x_inner)[:, None] + offs[None, :]
    h = tl.load(x_rows, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r_rows = (residual_ptr + (outer * stride_r_outer + inner * stride_r_inner)[:, None]
                  + offs[None, :])
        h = h.to(tl.float32) + tl.load(r_rows, mask=mask, other=0.0).to(tl.float32)
        h = h.to(x_ptr.dtype.element_ty)
        nr_rows = (new_residual_ptr + (outer * stride_nr_outer + inner * stride_nr_inner)[:, None]
                   + offs[None, :])
        tl.store(nr_rows, h, mask=mask)
    h32 = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h32 * h32, axis=1) / n_cols + eps)
    w = tl.load(weight_ptr + offs, mask=offs < n_cols, other=0.0)
    normed = (h32 * rstd[:, None]).to(x_ptr.dtype.element_ty)
    o_rows = out_ptr + (outer * stride_o_outer + inner * stride_o_inner)[:, None] + offs[None, :]
    tl.store(o_rows, (w.to(tl.float32)[None, :] * normed.to(tl.float32)).to(
        out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class RmsNormConfig:
    """Tile width along the row (a row wider than it is swept in tiles), warps per program, and
    rows per program (more than one only for rows that fit one tile)."""

    BLOCK_SIZE: int
    num_warps: int
    ROWS: int = 1

    def __post_init__(self) -> None:
        if self.ROWS < 1 or self.ROWS & (self.ROWS - 1):
            raise ValueError(f"ROWS: expected a power of two >= 1, got {self.ROWS}")


# One tile holds rows up to this width (H = 7168 for DeepSeek-V3 fits in 8192).
_MAX_BLOCK_SIZE = 8192


def rmsnorm_config(hidden_size: int, dtype: torch.dtype, mode: Mode = Mode.CORUN) -> RmsNormConfig:
    """Pure policy: depends on the row width and dtype only, never on the number of rows.

    Every mode gets the same config: the row kernel is batch-invariant already, so ``corun`` and
    ``batch_invariant`` need no constraint and ``default`` has nothing faster to switch to.

    fp32 rows of up to 256 are normalised 16 to a program. fp32 is the CPU engine's dtype, run
    by the Triton interpreter, which pays per program rather than per element: one row a program
    made rmsnorm 40% of a tiny model's engine step there (a q/k norm is a program per token and
    head). The GPU engine runs bf16 and keeps its measured one row a program.
    """
    del mode  # same tiling for every mode; kept in the signature (STYLE §6.5)
    block = min(next_power_of_2(hidden_size), _MAX_BLOCK_SIZE)
    num_warps = 1 if block <= 256 else 4 if block <= 2048 else 8 if block <= 4096 else 16
    rows = 16 if dtype == torch.float32 and block <= 256 else 1
    return RmsNormConfig(BLOCK_SIZE=block, num_warps=num_warps, ROWS=rows)


def _as_rows(name: str, t: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """View [..., H] as [outer, inner, H] without copying; returns (view, n_inner, strides)."""
    if t.dim() == 1:
        t = t.unsqueeze(0)
    if t.dim() == 2:
        return t, 1, t.stride(0), 0
    if t.dim() > 3:
        try:
            t = t.view(-1, t.shape[-2], t.shape[-1])
        except RuntimeError:
            raise ValueError(
                f"{name}: leading dims of shape {tuple(t.shape)} strides "
                f"{t.stride()} cannot be collapsed without a copy"
            ) from None
    return t, t.shape[1], t.stride(0), t.stride(1)


def rmsnorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    mode: Mode = Mode.CORUN,
    config: RmsNormConfig | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x [..., H] (contiguous last dim); returns out, or (out, x + residual).

    Outputs are new contiguous tensors of x's shape and dtype. Batch- and position-invariant under
    every mode (see the module docstring). ``config`` overrides the policy (tests use it to show a
    different tiling changes bits).
    """
    mode = Mode.parse(mode)
    check_tensor("x", x, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    if x.dim() == 0:
        raise ValueError("x: expected at least 1 dim, got a scalar")
    hidden = x.shape[-1]
    check_tensor("weight", weight, ndim=1, dtypes=(x.dtype,), contiguous=True)
    check_shape("weight", weight, (hidden,))
    if not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"eps: expected a positive float, got {eps!r}")
    check_same_device(x=x, weight=weight)
    if residual is not None:
        check_tensor("residual", residual, dtypes=(x.dtype,), last_dim_contiguous=True)
        check_shape("residual", residual, tuple(x.shape))
        check_same_device(x=x, residual=residual)

    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    new_residual = torch.empty_like(out) if residual is not None else out
    if x.numel() == 0:
        return (out, new_residual) if residual is not None else out
    cfg = config or rmsnorm_config(hidden, x.dtype, mode)

    x3, n_inner, sx0, sx1 = _as_rows("x", x)
    r3, _, sr0, sr1 = _as_rows("residual", residual) if residual is not None else (x3, 0, 0, 0)
    o3, _, so0, so1 = _as_rows("out", out)
    nr3, _, snr0, snr1 = _as_rows("new_residual", new_residual)
    n_rows = x.numel() // hidden
    num_blocks = triton.cdiv(hidden, cfg.BLOCK_SIZE)
    if cfg.ROWS > 1 and num_blocks > 1:
        raise ValueError(f"config: ROWS {cfg.ROWS} > 1 needs a row in one tile, got hidden "
                         f"{hidden} over BLOCK_SIZE {cfg.BLOCK_SIZE}")
    _rmsnorm_kernel[(triton.cdiv(n_rows, cfg.ROWS),)](
        x3,
        r3,
        weight,
        o3,
        nr3,
        n_inner,
        hidden,
        float(eps),
        sx0,
        sx1,
        sr0,
        sr1,
        so0,
        so1,
        snr0,
        snr1,
        n_rows,
        HAS_RESIDUAL=residual is not None,
        BLOCK_SIZE=cfg.BLOCK_SIZE,
        NUM_BLOCKS=num_blocks,
        ROWS=cfg.ROWS,
        num_warps=cfg.num_warps,
    )
    return (out, new_residual) if residual is not None else out
