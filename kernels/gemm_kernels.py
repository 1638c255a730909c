"""Triton kernels of the GEMM ``y = x @ w.T (+ bias)``; the launcher and policy are in ``gemm.py``.

``_gemm_kernel`` computes output tiles [BLOCK_M, BLOCK_N] with an fp32 accumulator, walking K in
BLOCK_K steps in increasing order. One *work item* is one output tile times one K split; the grid
is either one program per work item or fewer programs that loop over work items (persistent).
Which program handles a work item never changes its arithmetic, so persistence is free of bits.

Why rows are independent of each other: row r of the output reads only row r of ``x`` (rows past
M re-read a real row through ``% M``, or load zeros with ``MASK_ROWS``, and are never stored), and
``tl.dot`` computes each output
element from its own row and column. The only thing that sets a row's reduction order is the
K walk: BLOCK_K and the split boundaries. With ``split_k > 1`` each split writes an fp32 partial
to a workspace [split_k, M, N] and ``_splitk_reduce_kernel`` sums the partials in split order
0, 1, ..., split_k - 1: no atomics, so a fixed shape always gives the same bits.

Stream-K (``STREAM_K``, one row tile): the grid is P = ``stream_k_programs`` programs (at most
one an iteration, so none is empty: kernels.gemm.stream_k_programs), and
program p walks iterations [p * T // P, (p + 1) * T // P) of the T = column tiles x K blocks, so
each streams the same share of the weights whatever the tile count. A column tile whose K walk
is wholly in one program is stored directly; otherwise each program's piece goes to workspace slot
(p - the tile's first program), and the reduce launch sums the pieces in slot order. The cuts are
a function of (N, K, the tiles, P): the same for every row, and never of M.

With BLOCK_N_TAIL (``GemmConfig.block_n_tail``) a column tile is BLOCK_N + BLOCK_N_TAIL wide, a
width no power-of-two tile has: a second product from the same x tiles into its own accumulator,
stored beside the first. Each element is still summed over K in BLOCK_K steps, so the tail leaves
a row's reduction order as it was.

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


@triton.jit
def _load_x_tile(x_ptrs, offs_k, K, row_mask, EVEN_K: tl.constexpr, MASK_ROWS: tl.constexpr):
    """An x tile through per-thread loads: masked past K unless K is a whole number of tiles,
    and past M with MASK_ROWS (zeros either way; masks only where a constexpr says so)."""
    if EVEN_K:
        if MASK_ROWS:
            tile = tl.load(x_ptrs, mask=row_mask, other=0.0)
        else:
            tile = tl.load(x_ptrs)
    else:
        mask = offs_k[None, :] < K
        if MASK_ROWS:
            mask = mask & row_mask
        tile = tl.load(x_ptrs, mask=mask, other=0.0)
    return tile


@triton.jit
def _x_tile(x_ptr, pid_m, kb, offs_xm, row_mask, K, stride_xm, stride_xk,
            EVEN_K: tl.constexpr, TMA: tl.constexpr, MASK_ROWS: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Row tile pid_m's x tile [BLOCK_M, BLOCK_K] at K block kb."""
    if TMA:
        a = x_ptr.load([pid_m * BLOCK_M, kb * BLOCK_K])
    else:
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + offs_xm[:, None] * stride_xm + offs_k[None, :] * stride_xk
        a = _load_x_tile(x_ptrs, offs_k, K, row_mask, EVEN_K, MASK_ROWS)
    return a


@triton.jit
def _w_tile(w_ptr, col0, kb, N, K, stride_wn, stride_wk,
            EVEN_K: tl.constexpr, TMA: tl.constexpr, SERIAL_DOT: tl.constexpr,
            COLS: tl.constexpr, BLOCK_K: tl.constexpr):
    """The w tile [BLOCK_K, COLS] of columns [col0, col0 + COLS) at K block kb; columns past N
    re-read in-range ones (never stored; TMA zero-fills them)."""
    if TMA:
        b = w_ptr.load([col0, kb * BLOCK_K]).T
    else:
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        offs_wn = (col0 + tl.arange(0, COLS)) % N
        if SERIAL_DOT:
            # Interpreter only: w read as [COLS, BLOCK_K] and transposed, the layout of a TMA
            # tile, so the serial product sums both paths in one order and a config's bits do
            # not depend on whether its inputs were TMA-addressable.
            w_ptrs = w_ptr + offs_wn[:, None] * stride_wn + offs_k[None, :] * stride_wk
            b = tl.load(w_ptrs, mask=offs_k[None, :] < K, other=0.0).T
        else:
            w_ptrs = w_ptr + offs_k[:, None] * stride_wk + offs_wn[None, :] * stride_wn
            if EVEN_K:
                b = tl.load(w_ptrs)
            else:
                # Zero padding past K adds exact zeros: the sum over the real K is unchanged.
                b = tl.load(w_ptrs, mask=offs_k[:, None] < K, other=0.0)
    return b


@triton.jit
def _mma(a, b, acc, UPCAST: tl.constexpr, SERIAL_DOT: tl.constexpr,
         DOT_PRECISION: tl.constexpr):
    """acc + a @ b, each output element summed over the tile's K in one order."""
    if UPCAST:
        # Interpreter only: its bf16 dot is wrong, fp32 is exact (kernels.utils).
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if SERIAL_DOT:
        # Interpreter only: its tl.dot is numpy's BLAS matmul, whose FMA order for a row depends
        # on the row's slot in the BLAS micro-tile (measured: permuting rows changes fp32 bits).
        # A broadcast product summed over the tile's K in order, then added to acc, is the same
        # for every row, as the GPU's MMA is (DESIGN.md ground truth), and like the BLAS path it
        # still depends on BLOCK_K.
        prod = a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :]
        acc += tl.sum(prod, axis=1)
    else:
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _tile_product(
    x_ptr, w_ptr, w_tail_ptr, M, N, K, pid_m, pid_n, kb_start, kb_end,
    stride_xm, stride_xk, stride_wn, stride_wk,
    EVEN_K: tl.constexpr, UPCAST: tl.constexpr, SERIAL_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, TMA: tl.constexpr, MASK_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_N_TAIL: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The fp32 products of output tile (pid_m, pid_n) over K blocks [kb_start, kb_end),
    accumulated from zero in increasing K order: [BLOCK_M, BLOCK_N] of the tile's first
    columns and, with BLOCK_N_TAIL, [BLOCK_M, BLOCK_N_TAIL] of the next ones from the same x
    tiles (a column tile of BLOCK_N + BLOCK_N_TAIL; without a tail the second is unused)."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    col0 = pid_n * (BLOCK_N + BLOCK_N_TAIL)
    # Out-of-range rows/columns re-read in-range data instead of being masked in the K loop:
    # they are never stored, and no other row or column reads them. MASK_ROWS masks the rows
    # instead (zeros, no memory request): the same bits for every real row. TMA tiles need
    # neither: the descriptor zero-fills past M.
    offs_xm = offs_m % M
    row_mask = (offs_m < M)[:, None]  # read by the MASK_ROWS loads only
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if BLOCK_N_TAIL > 0:
        acc_tail = tl.zeros((BLOCK_M, BLOCK_N_TAIL), dtype=tl.float32)
    else:
        acc_tail = acc  # no tail product: never stored
    for kb in range(kb_start, kb_end):
        a = _x_tile(x_ptr, pid_m, kb, offs_xm, row_mask, K, stride_xm, stride_xk,
                    EVEN_K, TMA, MASK_ROWS, BLOCK_M, BLOCK_K)
        b = _w_tile(w_ptr, col0, kb, N, K, stride_wn, stride_wk, EVEN_K, TMA, SERIAL_DOT,
                    BLOCK_N, BLOCK_K)
        acc = _mma(a, b, acc, UPCAST, SERIAL_DOT, DOT_PRECISION)
        if BLOCK_N_TAIL > 0:
            b_tail = _w_tile(w_tail_ptr, col0 + BLOCK_N, kb, N, K, stride_wn, stride_wk, EVEN_K,
                             TMA, SERIAL_DOT, BLOCK_N_TAIL, BLOCK_K)
            acc_tail = _mma(a, b_tail, acc_tail, UPCAST, SERIAL_DOT, DOT_PRECISION)
    return acc, acc_tail


@triton.jit
def _store_output(acc, out_ptr, bias_ptr, pid_m, col0, M, N, stride_om, stride_on,
                  HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, COLS: tl.constexpr):
    """acc (+ bias) into the output's columns [col0, col0 + COLS) of row tile pid_m, in the
    output's dtype."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = col0 + tl.arange(0, COLS)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty),
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def _store_partial(acc, ws_ptr, slot, pid_m, col0, M, N, stride_ws,
                   BLOCK_M: tl.constexpr, COLS: tl.constexpr):
    """acc as fp32 into slot ``slot`` of the contiguous workspace [slots, M, N], at the columns
    [col0, col0 + COLS) of row tile pid_m."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = col0 + tl.arange(0, COLS)
    ws_ptrs = ws_ptr + slot * stride_ws + offs_m[:, None] * N + offs_n[None, :]
    tl.store(ws_ptrs, acc, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def _stream_k_first_program(pid_n, k_blocks, total, num_programs):
    """The program whose range holds column tile pid_n's first K block: program p holds
    iterations [p * total // P, (p + 1) * total // P) of the (column tile, K block) space."""
    return ((pid_n.to(tl.int64) * k_blocks + 1) * num_programs - 1) // total


@triton.jit
def _stream_k_last_program(pid_n, k_blocks, total, num_programs):
    """The program whose range holds column tile pid_n's last K block."""
    return ((pid_n.to(tl.int64) + 1) * k_blocks * num_programs - 1) // total


# M is not specialized: M == 1 or M % 16 == 0 would otherwise compile a separate binary, which
# costs compile time per batch size and is one more thing that could differ between batch sizes.
@triton.jit(do_not_specialize=["M"])
def _gemm_kernel(
    # pointers (ws_ptr: the fp32 workspace [slots, M, N] of split-K / stream-K partials)
    x_ptr, w_ptr, w_tail_ptr, bias_ptr, out_ptr, ws_ptr,
    # sizes
    M, N, K, split_k, k_blocks_per_split,
    # strides (out_ptr may be strided; the workspace is contiguous)
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ws, stride_om, stride_on,
    # meta-parameters
    HAS_BIAS: tl.constexpr,
    USE_WORKSPACE: tl.constexpr,
    STREAM_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    SERIAL_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr,
    MASK_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_N_TAIL: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    num_pid_n = tl.cdiv(N, BLOCK_N + BLOCK_N_TAIL)
    if STREAM_K:
        # One row tile (M <= BLOCK_M, checked by the launcher); the (column tile, K block)
        # iterations are cut into num_programs equal ranges, so every program streams the same
        # share of the weights whatever the tile count. A column tile's K walk is cut where the
        # ranges fall: a function of (N, K, the tiles, num_programs), never of M or a row.
        k_blocks = tl.cdiv(K, BLOCK_K)
        total = num_pid_n * k_blocks
        it = (pid.to(tl.int64) * total) // num_programs  # int64: pid * total may pass 2^31
        it_end = ((pid.to(tl.int64) + 1) * total) // num_programs
        while it < it_end:
            # int32 again: each is below the tile or K-block count (TMA offsets must be 32-bit)
            pid_n = (it // k_blocks).to(tl.int32)
            kb_start = (it % k_blocks).to(tl.int32)
            kb_end = tl.minimum(k_blocks, kb_start + (it_end - it)).to(tl.int32)
            acc, _ = _tile_product(  # no tail: GemmConfig refuses one with stream-K
                x_ptr, w_ptr, w_tail_ptr, M, N, K, 0, pid_n, kb_start, kb_end,
                stride_xm, stride_xk, stride_wn, stride_wk,
                EVEN_K, UPCAST, SERIAL_DOT, DOT_PRECISION, TMA, MASK_ROWS,
                BLOCK_M, BLOCK_N, 0, BLOCK_K,
            )
            first = _stream_k_first_program(pid_n, k_blocks, total, num_programs)
            last = _stream_k_last_program(pid_n, k_blocks, total, num_programs)
            if first == last:  # the whole K walk in this program: no partial round trip
                _store_output(acc, out_ptr, bias_ptr, 0, pid_n * BLOCK_N, M, N, stride_om,
                              stride_on, HAS_BIAS, BLOCK_M, BLOCK_N)
            else:  # piece (pid - first) of the tile, summed in piece order by the reduce
                _store_partial(acc, ws_ptr, pid - first, 0, pid_n * BLOCK_N, M, N, stride_ws,
                               BLOCK_M, BLOCK_N)
            it += kb_end - kb_start
    else:
        num_pid_m = tl.cdiv(M, BLOCK_M)
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
            kb_start = split * k_blocks_per_split
            kb_end = tl.minimum(kb_start + k_blocks_per_split, tl.cdiv(K, BLOCK_K))
            acc, acc_tail = _tile_product(
                x_ptr, w_ptr, w_tail_ptr, M, N, K, pid_m, pid_n, kb_start, kb_end,
                stride_xm, stride_xk, stride_wn, stride_wk,
                EVEN_K, UPCAST, SERIAL_DOT, DOT_PRECISION, TMA, MASK_ROWS,
                BLOCK_M, BLOCK_N, BLOCK_N_TAIL, BLOCK_K,
            )
            col0 = pid_n * (BLOCK_N + BLOCK_N_TAIL)
            if USE_WORKSPACE:
                _store_partial(acc, ws_ptr, split, pid_m, col0, M, N, stride_ws,
                               BLOCK_M, BLOCK_N)
                if BLOCK_N_TAIL > 0:
                    _store_partial(acc_tail, ws_ptr, split, pid_m, col0 + BLOCK_N, M, N,
                                   stride_ws, BLOCK_M, BLOCK_N_TAIL)
            else:
                _store_output(acc, out_ptr, bias_ptr, pid_m, col0, M, N, stride_om, stride_on,
                              HAS_BIAS, BLOCK_M, BLOCK_N)
                if BLOCK_N_TAIL > 0:
                    _store_output(acc_tail, out_ptr, bias_ptr, pid_m, col0 + BLOCK_N, M, N,
                                  stride_om, stride_on, HAS_BIAS, BLOCK_M, BLOCK_N_TAIL)


@triton.jit
def _splitk_reduce_kernel(
    # pointers
    ws_ptr, bias_ptr, out_ptr,
    # sizes
    M, N, K, split_k, stream_k_programs,
    # strides (workspace is contiguous [slots, M, N]; out may be strided)
    stride_ws, stride_om, stride_on,
    # meta-parameters
    HAS_BIAS: tl.constexpr,
    STREAM_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    REDUCE_ROWS: tl.constexpr,
):
    """Sums each element's partials in slot order ((p0 + p1) + p2) + ...: the reason split-K and
    stream-K stay deterministic at a fixed shape. Program (i, j) reduces rows [i * REDUCE_ROWS,
    ...) of column tile j (the GEMM's BLOCK_N columns). Split-K: split_k slots everywhere.
    Stream-K: the pieces of column tile j, found once per program (found per element, with int64
    divisions, they made this launch 27-57% of the stream-K GEMM's time on an H100, 10-74 us:
    probe-gemm-mid-m-h100-before.json); a tile of one piece was written by the GEMM, and its
    programs return at once."""
    pid_m = tl.program_id(0)
    tile_n = tl.program_id(1)
    if STREAM_K:
        k_blocks = tl.cdiv(K, BLOCK_K)
        total = tl.cdiv(N, BLOCK_N) * k_blocks
        first = _stream_k_first_program(tile_n, k_blocks, total, stream_k_programs)
        pieces = (_stream_k_last_program(tile_n, k_blocks, total, stream_k_programs)
                  - first + 1).to(tl.int32)
    else:
        pieces = split_k
    if pieces > 1:
        offs_m = pid_m * REDUCE_ROWS + tl.arange(0, REDUCE_ROWS)
        offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        offs = offs_m[:, None] * N + offs_n[None, :]
        acc = tl.load(ws_ptr + offs, mask=mask, other=0.0)
        for s in range(1, pieces):
            acc += tl.load(ws_ptr + s * stride_ws + offs, mask=mask, other=0.0)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
                 acc.to(out_ptr.dtype.element_ty), mask=mask)
