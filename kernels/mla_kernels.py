"""Triton kernels of multi-head latent attention (DeepSeek-V3 MLA); launchers in kernels/mla.py
(the cache write, ``store_mla_kv``, is in kernels/kv_store.py with its kernel).

- ``_mla_decode_kernel`` + ``_mla_decode_combine_kernel``: absorbed decode as split-KV MQA.
  Program (head block, b, split) runs an online softmax over its split's tokens for BLOCK_H
  query heads at once (all heads share the one latent "kv head", so each latent tile is read once
  per head block, and the two head blocks of 128 heads read it together, from L2 the second
  time). A sequence that is one split writes its output directly; a longer one writes normalised
  fp32 partials and log2-sum-exps, which the combine program (b, head group) folds in split order.
- ``_mla_prefill_kernel``: dense variable-length causal flash attention with separate qk and v head
  dims (192 = 128 + 64 as two dot products), bottom-right aligned, keys always walked from key 0
  in BLOCK_N steps; unmasked loads for the key tiles a query tile sees whole.

Decode's step order: the P.V product of latent tile j runs in step j + 1, after the Q.K product
of tile j + 1. Triton assigns a dot's warps by whether the dot's result feeds another dot in the
same step: if it does, all warps go along the M axis, and with 64 heads (one warp group's M) on 8
warps both warp groups would compute the same Q.K (measured in the sm_90 TTGIR: warpsPerCTA
[8, 1], twice the wgmma count). Carrying P and the latent tile into the next step makes Q.K a
dot whose result only leaves the step, so its tokens split across the two warp groups. The
[64, 512] fp32 accumulator is split the same way (half each). With DV_PARTS > 1 the grid also
splits the output columns: each program computes the same scores and accumulates 512 / DV_PARTS
columns, a smaller accumulator at the price of recomputing Q.K (the offline ptxas report,
experiments/ptxas_report.py, shows the one-part tiles spilling and the split ones not).

Why the bits are what they are: a row's result depends on the tile sizes (fixed by the policy in
kernels/mla.py) and on the order its tokens are reduced in. Decode reduces each split's tokens in
BLOCK_N steps from the split start, and folds splits in index order; where the split boundaries
fall is the mode's choice (kernels/mla.py); whether a sequence takes the direct path (one split)
is a function of its own length. Prefill walks keys 0, BLOCK_N, 2 BLOCK_N, ... for every row; key
blocks past a row's own position are fully masked and leave its running max, sum and accumulator
exactly unchanged, so a row's bits do not depend on which other rows share its tile, how the
prompt was chunked, or where in a packed step its rows sit.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.attention_kernels import _preload_block_ids, _preloaded_block, _zero_padding_rows

# log2(e): the kernels run their softmax in base 2 (exp2 is one instruction on the GPU).
LOG2E = 1.4426950408889634


@triton.jit
def _load_rows(base_ptr, rows, offs_d, row_mask, D_END: tl.constexpr, D_FULL: tl.constexpr,
               ROW_MASKED: tl.constexpr):
    """Load a [rows, offs_d] tile; masks are emitted only where a constexpr says they are needed
    (D_FULL: every column of offs_d is < D_END), so full tiles take plain vector loads."""
    ptrs = base_ptr + rows[:, None] + offs_d[None, :]
    if ROW_MASKED:
        if D_FULL:
            tile = tl.load(ptrs, mask=row_mask[:, None], other=0.0)
        else:
            tile = tl.load(ptrs, mask=row_mask[:, None] & (offs_d < D_END)[None, :], other=0.0)
    else:
        if D_FULL:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=(offs_d < D_END)[None, :], other=0.0)
    return tile


@triton.jit
def _value_rows(base_ptr, rows, offs_v, row_mask, D_END: tl.constexpr, D_FULL: tl.constexpr,
                UPCAST: tl.constexpr):
    """A latent tile's own value columns (``_load_rows``), upcast where the interpreter needs it."""
    tile = _load_rows(base_ptr, rows, offs_v, row_mask, D_END, D_FULL, True)
    if UPCAST:
        tile = tile.to(tl.float32)
    return tile


@triton.jit
def _split_len(seq_len, split_size, num_splits, BLOCK_N: tl.constexpr):
    """Tokens per split of one sequence: exactly ``split_size`` when it is > 0 (corun /
    batch_invariant), else the sequence spread over ``num_splits`` splits rounded up to whole
    BLOCK_N tiles (default; never below BLOCK_N, so that a length-0 sequence divides safely: it has
    no split either way). A run-time choice, so both modes share one compiled kernel."""
    if split_size > 0:
        split_len = split_size
    else:
        split_len = tl.maximum(tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N, BLOCK_N)
    return split_len


@triton.jit(do_not_specialize=["num_splits"])
def _mla_decode_kernel(
    # pointers
    q_latent_ptr, q_pe_ptr, kv_cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, mid_out_ptr,
    mid_lse_ptr,
    # sizes
    num_heads, split_size, num_splits, qk_scale,
    # strides
    stride_ql_b, stride_ql_h, stride_qp_b, stride_qp_h, stride_cache_b, stride_cache_t,
    stride_bt_b, stride_o_b, stride_o_h, stride_mo_b, stride_mo_h, stride_mo_s, stride_ml_b,
    stride_ml_h,
    # constexprs
    LATENT_DIM: tl.constexpr, ROPE_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_R: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, DV_PARTS: tl.constexpr,
    SPLIT_PAGES: tl.constexpr, RELOAD_VALUES: tl.constexpr,
):
    """Program (head block x value part, sequence, split): online softmax over the split's tokens
    for BLOCK_H heads, accumulating BLOCK_DV / DV_PARTS of the latent output columns (every part
    computes the same scores; DV_PARTS > 1 shrinks the fp32 accumulator, not the softmax). A
    sequence of one split writes its output directly; one of several writes an fp32 partial and
    its log2-sum-exp for _mla_decode_combine_kernel; length 0 writes zeros. SPLIT_PAGES > 0: the
    split's block ids (at most that many pages) are loaded before the token loop and each tile
    gathers its own from them, so no latent tile's address waits on a load inside the loop and
    the compiler can keep the next tile's load in flight during this tile's products (compiled
    for sm_90a: two latent buffers instead of one); the same rows reach the same dots.
    RELOAD_VALUES: the latent rows P.V takes one step late are loaded again in that step (from
    L2 or L1) instead of carried in registers: carried, the [BLOCK_N, BLOCK_DV / DV_PARTS] tile
    holds registers across the step and is written back to shared memory for its wgmma every
    step (sm_90a TTGIR, Triton 3.6); reloaded, it is copied into shared memory like the others.
    The same rows reach the same dots."""
    # Head blocks and value parts on the fastest grid axis: the programs that read the same cache
    # tiles (one sequence, one split, every head block and part) run together, so re-reads hit L2.
    pid_h = tl.program_id(0) // DV_PARTS
    pid_v = tl.program_id(0) % DV_PARTS
    pid_b = tl.program_id(1)
    pid_s = tl.program_id(2)
    BLOCK_VP: tl.constexpr = BLOCK_DV // DV_PARTS
    V_FULL: tl.constexpr = BLOCK_VP * DV_PARTS <= LATENT_DIM  # every value column is real
    seq_len = tl.load(seq_lens_ptr + pid_b)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < num_heads
    offs_d = tl.arange(0, BLOCK_DV)
    offs_v = pid_v * BLOCK_VP + tl.arange(0, BLOCK_VP)  # this program's output columns
    mask_v = offs_v < LATENT_DIM
    o_ptrs = (out_ptr + pid_b.to(tl.int64) * stride_o_b + offs_h[:, None] * stride_o_h
              + offs_v[None, :])
    if seq_len == 0:  # a padded dummy slot: zeros, written once
        if pid_s == 0:
            tl.store(o_ptrs, tl.zeros([BLOCK_H, BLOCK_VP], dtype=out_ptr.dtype.element_ty),
                     mask=mask_h[:, None] & mask_v[None, :])
        return
    split_len = _split_len(seq_len, split_size, num_splits, BLOCK_N)
    split_start = pid_s * split_len
    split_end = tl.minimum(split_start + split_len, seq_len)
    # The grid is sized for the longest allowed sequence; splits past this one's end do nothing.
    if split_start >= split_end:
        return

    offs_r = tl.arange(0, BLOCK_R)
    q = _load_rows(q_latent_ptr + pid_b.to(tl.int64) * stride_ql_b, offs_h * stride_ql_h, offs_d,
                   mask_h, LATENT_DIM, BLOCK_DV <= LATENT_DIM, True)
    q_pe = _load_rows(q_pe_ptr + pid_b.to(tl.int64) * stride_qp_b, offs_h * stride_qp_h, offs_r,
                      mask_h, ROPE_DIM, BLOCK_R <= ROPE_DIM, True)
    kv_dtype = kv_cache_ptr.dtype.element_ty
    # The previous tile's probabilities and latent rows, whose P.V product runs one iteration
    # late (module docstring): zeros before the first tile, so its product adds exact zeros.
    p_prev = tl.zeros([BLOCK_H, BLOCK_N], dtype=kv_dtype)
    v_prev = tl.zeros([BLOCK_N, BLOCK_VP], dtype=kv_dtype)
    # RELOAD_VALUES: where the previous tile's rows sit (none before the first: zeros are read)
    rows_prev = tl.zeros([BLOCK_N], dtype=tl.int64)
    mask_prev = tl.zeros([BLOCK_N], dtype=tl.int1)
    if UPCAST:  # interpreter only: its bf16 tl.dot is wrong (kernels.utils.upcast_dot_operands)
        q = q.to(tl.float32)
        q_pe = q_pe.to(tl.float32)
        p_prev = p_prev.to(tl.float32)
        v_prev = v_prev.to(tl.float32)
    alpha_prev = tl.full([BLOCK_H], 1.0, dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_VP], dtype=tl.float32)
    bt_ptr = block_tables_ptr + pid_b.to(tl.int64) * stride_bt_b
    if SPLIT_PAGES > 0:
        first_page = split_start // PAGE_SIZE
        split_ids = _preload_block_ids(bt_ptr, first_page, split_end, PAGE_SIZE, SPLIT_PAGES)
    for start_n in range(split_start, split_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < split_end
        if SPLIT_PAGES > 0:
            blocks = _preloaded_block(split_ids, first_page, offs_n, PAGE_SIZE, SPLIT_PAGES)
        else:
            blocks = tl.load(bt_ptr + offs_n // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
        rows = blocks * stride_cache_b + (offs_n % PAGE_SIZE) * stride_cache_t
        # The latent rows are the key (with k_pe) and, next iteration, the value: one load when
        # the program accumulates every column and carries them, else its own columns again.
        c = _load_rows(kv_cache_ptr, rows, offs_d, mask_n, LATENT_DIM, BLOCK_DV <= LATENT_DIM,
                       True)
        k_pe = _load_rows(kv_cache_ptr + LATENT_DIM, rows, offs_r, mask_n, ROPE_DIM,
                          BLOCK_R <= ROPE_DIM, True)
        if RELOAD_VALUES:  # the previous tile's value columns, again (an L2 or L1 hit)
            v_prev = _value_rows(kv_cache_ptr, rows_prev, offs_v, mask_prev, LATENT_DIM,
                                 V_FULL, UPCAST)
        elif DV_PARTS > 1:  # this tile's own value columns, for the next step's product
            v = _value_rows(kv_cache_ptr, rows, offs_v, mask_n, LATENT_DIM,
                            V_FULL, UPCAST)
        if UPCAST:
            c = c.to(tl.float32)
            k_pe = k_pe.to(tl.float32)
        acc = tl.dot(p_prev, v_prev, acc * alpha_prev[:, None], input_precision=DOT_PRECISION)
        # Two products, each scaled before the sum: no dot consumes another dot's result, so the
        # compiler splits this one's tokens across the warp groups instead of computing it twice.
        qk = (tl.dot(q, tl.trans(c), input_precision=DOT_PRECISION) * qk_scale
              + tl.dot(q_pe, tl.trans(k_pe), input_precision=DOT_PRECISION) * qk_scale)
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))  # finite: a tile's first token is always real
        alpha_prev = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(qk - m_new[:, None])
        l_i = l_i * alpha_prev + tl.sum(p, 1)
        m_i = m_new
        p_prev = p.to(kv_dtype)
        if UPCAST:
            p_prev = p_prev.to(tl.float32)
        if not RELOAD_VALUES:  # carried into the next step
            if DV_PARTS == 1:
                v_prev = c
            else:
                v_prev = v
        rows_prev = rows
        mask_prev = mask_n
    if RELOAD_VALUES:
        v_prev = _value_rows(kv_cache_ptr, rows_prev, offs_v, mask_prev, LATENT_DIM,
                             V_FULL, UPCAST)
    acc = tl.dot(p_prev, v_prev, acc * alpha_prev[:, None], input_precision=DOT_PRECISION)

    mask_o = mask_h[:, None] & mask_v[None, :]
    if tl.cdiv(seq_len, split_len) == 1:  # the whole sequence: no partial round trip
        tl.store(o_ptrs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=mask_o)
    else:
        mo_ptr = mid_out_ptr + pid_b.to(tl.int64) * stride_mo_b + pid_s * stride_mo_s
        tl.store(mo_ptr + offs_h[:, None] * stride_mo_h + offs_v[None, :], acc / l_i[:, None],
                 mask=mask_o)
        if pid_v == 0:  # every part computed the same log2-sum-exp: one writes it
            ml_ptr = mid_lse_ptr + pid_b.to(tl.int64) * stride_ml_b + pid_s
            tl.store(ml_ptr + offs_h * stride_ml_h, m_i + tl.math.log2(l_i), mask=mask_h)


@triton.jit(do_not_specialize=["num_splits"])
def _mla_decode_combine_kernel(
    # pointers
    mid_out_ptr, mid_lse_ptr, seq_lens_ptr, out_ptr,
    # sizes
    num_heads, split_size, num_splits,
    # strides
    stride_mo_b, stride_mo_h, stride_mo_s, stride_ml_b, stride_ml_h, stride_o_b, stride_o_h,
    # constexprs
    LATENT_DIM: tl.constexpr, BLOCK_HC: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """Program (sequence, head group): folds a sequence's split partials in split order 0, 1, ...
    (a function of the sequence's own splits only). Sequences of 0 or 1 split were written by
    _mla_decode_kernel and are skipped."""
    pid_b = tl.program_id(0)
    pid_h = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + pid_b)
    split_len = _split_len(seq_len, split_size, num_splits, BLOCK_N)
    num_valid = tl.cdiv(seq_len, split_len)
    if num_valid <= 1:
        return
    offs_h = pid_h * BLOCK_HC + tl.arange(0, BLOCK_HC)
    mask_h = offs_h < num_heads
    offs_d = tl.arange(0, BLOCK_DV)
    mask = mask_h[:, None] & (offs_d < LATENT_DIM)[None, :]
    mo_ptrs = (mid_out_ptr + pid_b.to(tl.int64) * stride_mo_b + offs_h[:, None] * stride_mo_h
               + offs_d[None, :])
    ml_ptrs = mid_lse_ptr + pid_b.to(tl.int64) * stride_ml_b + offs_h * stride_ml_h
    e_max = tl.full([BLOCK_HC], float("-inf"), dtype=tl.float32)
    e_sum = tl.zeros([BLOCK_HC], dtype=tl.float32)
    acc = tl.zeros([BLOCK_HC, BLOCK_DV], dtype=tl.float32)
    for s in range(0, num_valid):
        lse = tl.load(ml_ptrs + s, mask=mask_h, other=0.0)
        part = tl.load(mo_ptrs + s * stride_mo_s, mask=mask, other=0.0)
        new_max = tl.maximum(lse, e_max)
        old_scale = tl.math.exp2(e_max - new_max)
        weight = tl.math.exp2(lse - new_max)
        acc = acc * old_scale[:, None] + weight[:, None] * part
        e_sum = e_sum * old_scale + weight
        e_max = new_max
    o_ptrs = out_ptr + pid_b.to(tl.int64) * stride_o_b + offs_h[:, None] * stride_o_h
    tl.store(o_ptrs + offs_d[None, :], (acc / e_sum[:, None]).to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _mla_prefill_tile(
    acc, m_i, l_i, q1, q2, q_pos,
    k_ptr, k2_ptr, v_ptr, k_start, start_n, k_len, head, k_head_off, v_head_off, stride_k_t,
    stride_v_t, qk_scale,
    QK_DIM: tl.constexpr, V_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D1: tl.constexpr,
    BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr, MASKED: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr,
):
    """One online-softmax step over keys [start_n, start_n + BLOCK_N) of one head.

    The qk dim is two dot products (192 = 128 + 64: no padding to 256). MASKED=False serves only
    tiles that every row of the query tile fully sees, and computes the same bits as MASKED=True
    does for such rows: the mask is a select on the raw scores, and the rest is one expression
    graph (as in kernels/attention_kernels._prefill_tile).
    """
    offs_n = start_n + tl.arange(0, BLOCK_N)
    n_mask = offs_n < k_len  # all true in unmasked tiles, whose loads skip it
    k_rows = (k_start + offs_n).to(tl.int64) * stride_k_t + k_head_off
    if TMA:  # rows past this sequence hold other data: masked from the scores below
        k1 = tl.reshape(k_ptr.load([k_start + start_n, head, 0]), [BLOCK_N, BLOCK_D1])
    else:
        k1 = _load_rows(k_ptr, k_rows, tl.arange(0, BLOCK_D1), n_mask, QK_DIM,
                        BLOCK_D1 <= QK_DIM, MASKED)
    if UPCAST:
        k1 = k1.to(tl.float32)
    scores = tl.dot(q1, tl.trans(k1), input_precision=DOT_PRECISION)
    if BLOCK_D2 > 0:
        if TMA:  # columns past the qk dim are outside the descriptor: zero-filled
            k2 = tl.reshape(k2_ptr.load([k_start + start_n, head, BLOCK_D1]), [BLOCK_N, BLOCK_D2])
        else:
            k2 = _load_rows(k_ptr, k_rows, BLOCK_D1 + tl.arange(0, BLOCK_D2), n_mask, QK_DIM,
                            BLOCK_D1 + BLOCK_D2 <= QK_DIM, MASKED)
        if UPCAST:
            k2 = k2.to(tl.float32)
        scores = tl.dot(q2, tl.trans(k2), scores, input_precision=DOT_PRECISION)
    if MASKED:
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        scores = tl.where(visible, scores, float("-inf"))
    # The row max of the raw scores, scaled once: rounding is monotone and qk_scale > 0 (the
    # launcher checks it), so it is the max of the scaled scores bit for bit, without a multiply
    # per score for the max alone. The exponent's `scores * qk_scale - m` is one FMA under
    # Triton's default fp fusion either way, as it was when the max read the scaled scores.
    m_new = tl.maximum(m_i, tl.max(scores, 1) * qk_scale)
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(scores * qk_scale - m_new[:, None])
    l_new = l_i * alpha + tl.sum(p, 1)
    v_rows = (k_start + offs_n).to(tl.int64) * stride_v_t + v_head_off
    if TMA:
        v = tl.reshape(v_ptr.load([k_start + start_n, head, 0]), [BLOCK_N, BLOCK_DV])
        if MASKED:  # rows past this sequence may be unwritten (NaN): zeros, as the pointer path
            v = tl.where(n_mask[:, None], v, 0.0)
    else:
        v = _load_rows(v_ptr, v_rows, tl.arange(0, BLOCK_DV), n_mask, V_DIM, BLOCK_DV <= V_DIM,
                       MASKED)
    p_dot = p.to(v.dtype)
    if UPCAST:
        p_dot = p_dot.to(tl.float32)
        v = v.to(tl.float32)
    acc_new = tl.dot(p_dot, v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    if MASKED:
        # A row that sees no key of this tile keeps its state exactly (adding the all-zero
        # product would still turn an accumulated -0.0 into +0.0).
        live = start_n <= q_pos
        acc_new = tl.where(live[:, None], acc_new, acc)
        l_new = tl.where(live, l_new, l_i)
        m_new = tl.where(live, m_new, m_i)
    return acc_new, m_new, l_new


@triton.jit
def _mla_prefill_kernel(
    # pointers
    q_ptr, k_ptr, k2_ptr, v_ptr, out_ptr, cu_seqlens_q_ptr, cu_seqlens_k_ptr,
    # sizes
    num_tokens, num_seqs, num_m_tiles, qk_scale,
    # strides
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h, stride_o_t,
    stride_o_h,
    # constexprs
    QK_DIM: tl.constexpr, V_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr,
):
    """One program per (query tile, head, sequence); the sequence index num_seqs zeroes the
    padding rows after cu_seqlens_q[-1]. Query tiles of one head are adjacent in the grid, so the
    programs running together share that head's keys in L2. With TMA, k_ptr / k2_ptr / v_ptr are
    descriptors over [S, H, D] (the first and second qk parts, the values)."""
    # Heaviest (last) query tiles first: causal work grows with the tile index.
    pid_m = num_m_tiles - 1 - tl.program_id(0)
    pid_h = tl.program_id(1)
    pid_b = tl.program_id(2)
    if pid_b == num_seqs:
        _zero_padding_rows(out_ptr, tl.load(cu_seqlens_q_ptr + num_seqs), num_tokens, pid_m,
                           num_m_tiles, pid_h * stride_o_h, V_DIM, stride_o_t, BLOCK_M, BLOCK_DV)
        return
    q_start = tl.load(cu_seqlens_q_ptr + pid_b)
    q_len = tl.load(cu_seqlens_q_ptr + pid_b + 1) - q_start
    if pid_m * BLOCK_M >= q_len:  # the grid is sized for the longest chunk
        return
    k_start = tl.load(cu_seqlens_k_ptr + pid_b)
    k_len = tl.load(cu_seqlens_k_ptr + pid_b + 1) - k_start
    first_pos = k_len - q_len  # bottom-right aligned: position of the chunk's first query

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < q_len
    q_pos = first_pos + offs_m
    q_rows = (q_start + offs_m).to(tl.int64) * stride_q_t + pid_h * stride_q_h
    q1 = _load_rows(q_ptr, q_rows, tl.arange(0, BLOCK_D1), m_mask, QK_DIM, BLOCK_D1 <= QK_DIM,
                    True)
    if UPCAST:
        q1 = q1.to(tl.float32)
    q2 = q1  # unused when the qk dim is one power of 2
    if BLOCK_D2 > 0:
        q2 = _load_rows(q_ptr, q_rows, BLOCK_D1 + tl.arange(0, BLOCK_D2), m_mask, QK_DIM,
                        BLOCK_D1 + BLOCK_D2 <= QK_DIM, True)
        if UPCAST:
            q2 = q2.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    k_head_off = pid_h * stride_k_h
    v_head_off = pid_h * stride_v_h
    tile_first_pos = first_pos + pid_m * BLOCK_M
    tile_last_pos = tl.minimum(first_pos + (pid_m + 1) * BLOCK_M, k_len) - 1
    # Key tiles wholly at or below the tile's first query position: every row sees every key.
    full_end = ((tile_first_pos + 1) // BLOCK_N) * BLOCK_N
    for start_n in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _mla_prefill_tile(
            acc, m_i, l_i, q1, q2, q_pos, k_ptr, k2_ptr, v_ptr, k_start, start_n, k_len, pid_h,
            k_head_off, v_head_off, stride_k_t, stride_v_t, qk_scale, QK_DIM, V_DIM, BLOCK_N,
            BLOCK_D1, BLOCK_D2, BLOCK_DV, False, UPCAST, DOT_PRECISION, TMA,
        )
    # The diagonal tiles, with the causal and length mask.
    for start_n in range(full_end, tile_last_pos + 1, BLOCK_N):
        acc, m_i, l_i = _mla_prefill_tile(
            acc, m_i, l_i, q1, q2, q_pos, k_ptr, k2_ptr, v_ptr, k_start, start_n, k_len, pid_h,
            k_head_off, v_head_off, stride_k_t, stride_v_t, qk_scale, QK_DIM, V_DIM, BLOCK_N,
            BLOCK_D1, BLOCK_D2, BLOCK_DV, True, UPCAST, DOT_PRECISION, TMA,
        )
    out = acc / l_i[:, None]
    offs_dv = tl.arange(0, BLOCK_DV)
    o_rows = (q_start + offs_m).to(tl.int64) * stride_o_t + pid_h * stride_o_h
    tl.store(out_ptr + o_rows[:, None] + offs_dv[None, :], out.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & (offs_dv < V_DIM)[None, :])
