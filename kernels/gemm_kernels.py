"""Triton kernels of the GEMM ``y = x @ w.T (+ bias)``; the launcher and policy are in ``gemm.py``.

``_gemm_kernel`` computes output tiles [BLOCK_M, BLOCK_N] with an fp32 accumulator, walking K in
BLOCK_K steps in increasing order. One *work item* is one output tile times one K split; the grid
is either one program per work item or fewer programs that loop over work items (persistent).
Which program handles a work item never changes its arithmetic, so persistence is free of bits.

Why rows are independent of each other: row r of the output reads only row r of ``x`` (rows past
M re-read a real row through ``% M`` and are never stored), and ``tl.dot`` computes each output
element from its own row and column. The only thing that sets a row's reduction order is the
K walk: BLOCK_K and the split boundaries. With ``split_k > 1`` each split writes an fp32 partial
to a workspace [split_k, M, N] and ``_splitk_reduce_kernel`` sums the partials in split order
0, 1, ..., split_k - 1: no atomics, so a fixed shape always gives the same bits.

With TMA (a config flag; x_ptr and w_ptr are then host-side tensor descriptors) the x and w
tiles arrive through the Hopper tensor-memory accelerator, zero-filled past M, N and K, instead
of per-thread loads; the tiles a real row and column see, and the dot that consumes them, are the
same, so a real row's bits are too.

Under the Triton interpreter (CPU tests) two constexpr flags, both off on GPUs, swap the tile
product: UPCAST (bf16 -> fp32, the interpreter's bf16 dot is wrong) and SERIAL_DOT (a broadcast
multiply-and-sum instead of numpy's BLAS matmul, which is not row-order invariant).
"""

from __future__ import annotations

import triton
import triton.language as tl


# M is not specialized: M == 1 or M % 16 == 0 would otherwise compile a separate binary, which
# costs compile time per batch size and is one more thing that could differ between batch sizes.
@triton.jit(do_not_specialize=["M"])
def _gemm_kernel(
    # pointers
    x_ptr, w_ptr, bias_ptr, out_ptr,
    # sizes
    M, N, K, split_k, k_blocks_per_split,
    # strides (out_ptr is the output [M, N], or the fp32 workspace [split_k, M, N])
    stride_xm, stride_xk, stride_wn, stride_wk, stride_os, stride_om, stride_on,
    # meta-parameters
    HAS_BIAS: tl.constexpr,
    USE_WORKSPACE: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    SERIAL_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_work = num_pid_m * num_pid_n * split_k
    for work in range(pid, num_work, num_programs):
        tile = work // split_k
        split = work % split_k
        # Grouped ordering: GROUP_M row-tiles share each column-tile of w while it is in L2
        # (Triton tutorial 03).
        num_pid_in_group = GROUP_M * num_pid_n
        group_id = tile // num_pid_in_group
        first_pid_m = group_id * GROUP_M
        group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
        pid_m = first_pid_m + ((tile % num_pid_in_group) % group_size_m)
        pid_n = (tile % num_pid_in_group) // group_size_m

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        # Out-of-range rows/columns re-read in-range data instead of being masked in the K loop:
        # they are never stored, and no other row or column reads them.
        offs_xm = offs_m % M
        offs_wn = offs_n % N

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        kb_start = split * k_blocks_per_split
        kb_end = tl.minimum(kb_start + k_blocks_per_split, tl.cdiv(K, BLOCK_K))
        for kb in range(kb_start, kb_end):
            if TMA:
                a = x_ptr.load([pid_m * BLOCK_M, kb * BLOCK_K])
                b = w_ptr.load([pid_n * BLOCK_N, kb * BLOCK_K]).T
            else:
                offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
                x_ptrs = x_ptr + offs_xm[:, None] * stride_xm + offs_k[None, :] * stride_xk
                if SERIAL_DOT:
                    # Interpreter only: w read as [BLOCK_N, BLOCK_K] and transposed, the layout
                    # of a TMA tile, so the serial product below sums both paths in one order and
                    # a config's bits do not depend on whether its inputs were TMA-addressable.
                    w_ptrs = w_ptr + offs_wn[:, None] * stride_wn + offs_k[None, :] * stride_wk
                    a = tl.load(x_ptrs, mask=offs_k[None, :] < K, other=0.0)
                    b = tl.load(w_ptrs, mask=offs_k[None, :] < K, other=0.0).T
                else:
                    w_ptrs = w_ptr + offs_k[:, None] * stride_wk + offs_wn[None, :] * stride_wn
                    if EVEN_K:
                        a = tl.load(x_ptrs)
                        b = tl.load(w_ptrs)
                    else:
                        # Zero padding past K adds exact zeros: the sum over the real K is
                        # unchanged.
                        a = tl.load(x_ptrs, mask=offs_k[None, :] < K, other=0.0)
                        b = tl.load(w_ptrs, mask=offs_k[:, None] < K, other=0.0)
            if UPCAST:
                # Interpreter only: its bf16 dot is wrong, fp32 is exact (kernels.utils).
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            if SERIAL_DOT:
                # Interpreter only: its tl.dot is numpy's BLAS matmul, whose FMA order for a row
                # depends on the row's slot in the BLAS micro-tile (measured: permuting rows
                # changes fp32 bits). A broadcast product summed over the tile's K in order, then
                # added to acc, is the same for every row, as the GPU's MMA is (DESIGN.md ground
                # truth), and like the BLAS path it still depends on BLOCK_K.
                prod = a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :]
                acc += tl.sum(prod, axis=1)
            else:
                acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)

        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        if USE_WORKSPACE:
            out_ptrs = (out_ptr + split * stride_os
                        + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on)
            tl.store(out_ptrs, acc, mask=mask)
        else:
            if HAS_BIAS:
                bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
                acc += bias.to(tl.float32)[None, :]
            out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _splitk_reduce_kernel(
    # pointers
    ws_ptr, bias_ptr, out_ptr,
    # sizes
    M, N, split_k,
    # strides (workspace is contiguous [split_k, M, N]; out may be strided)
    stride_ws, stride_om, stride_on,
    # meta-parameters
    HAS_BIAS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < M * N
    # Fixed order ((p0 + p1) + p2) + ...: the reason split-K stays deterministic at a fixed shape.
    acc = tl.load(ws_ptr + offs, mask=mask, other=0.0)
    for s in range(1, split_k):
        acc += tl.load(ws_ptr + s * stride_ws + offs, mask=mask, other=0.0)
    offs_m = offs // N
    offs_n = offs % N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_m * stride_om + offs_n * stride_on,
             acc.to(out_ptr.dtype.element_ty), mask=mask)
