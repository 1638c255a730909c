"""Triton kernels of multi-head latent attention (DeepSeek-V3 MLA); launchers in kernels/mla.py.

- ``_store_mla_kv_kernel``: one program per token writes ``[latent | k_pe]`` into the paged MLA
  cache ``[num_blocks, block_size, latent_dim + rope_dim]``; slot -1 is skipped.
- ``_mla_decode_split_kernel`` + ``_mla_decode_combine_kernel``: absorbed decode as split-KV MQA.
  Program (head block, b, split) runs an online softmax over its split's tokens for BLOCK_H
  query heads at once (all heads share the one latent "kv head", so each cache tile is read once
  per head block; BLOCK_H in {16, 32, 64} trades those re-reads against the [BLOCK_H, latent]
  fp32 accumulator's registers) and writes a normalised fp32 partial and its log2-sum-exp; the
  combine program (b, h) merges the partials in split order.
- ``_mla_prefill_kernel``: dense variable-length causal flash attention with separate qk and v head
  dims, bottom-right aligned, keys always walked from key 0 in BLOCK_N steps.

Why the bits are what they are: a row's result depends on the tile sizes (fixed by the policy in
kernels/mla.py) and on the order its tokens are reduced in. Decode reduces each split's tokens in
BLOCK_N steps from the split start, and merges splits in index order; where the split boundaries
fall is the mode's choice (kernels/mla.py). Prefill walks keys 0, BLOCK_N, 2 BLOCK_N, ... for every
row; key blocks past a row's own position are fully masked, which leaves its running max, sum and
accumulator exactly unchanged (alpha = exp2(0) = 1, p = 0), so a row's bits do not depend on which
other rows share its tile or how the prompt was chunked.
"""

from __future__ import annotations

import triton
import triton.language as tl

# log2(e): the kernels run their softmax in base 2 (exp2 is one instruction on the GPU).
LOG2E = 1.4426950408889634


@triton.jit
def _store_mla_kv_kernel(
    # pointers
    latent_ptr,
    k_pe_ptr,
    kv_cache_ptr,
    slot_mapping_ptr,
    # sizes
    latent_dim,
    rope_dim,
    block_size,
    # strides
    stride_latent_t,
    stride_k_pe_t,
    stride_cache_b,
    stride_cache_t,
    # constexprs
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    pid_t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + pid_t).to(tl.int64)
    if slot < 0:  # padded token: nothing to write
        return
    row_ptr = (
        kv_cache_ptr + (slot // block_size) * stride_cache_b + (slot % block_size) * stride_cache_t
    )
    offs_l = tl.arange(0, BLOCK_L)
    mask_l = offs_l < latent_dim
    latent = tl.load(latent_ptr + pid_t.to(tl.int64) * stride_latent_t + offs_l, mask=mask_l)
    tl.store(row_ptr + offs_l, latent, mask=mask_l)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < rope_dim
    k_pe = tl.load(k_pe_ptr + pid_t.to(tl.int64) * stride_k_pe_t + offs_r, mask=mask_r)
    tl.store(row_ptr + latent_dim + offs_r, k_pe, mask=mask_r)


@triton.jit
def _split_len(
    seq_len, split_size, num_splits, IS_FIXED_SPLIT: tl.constexpr, BLOCK_N: tl.constexpr
):
    """Tokens per split of one sequence: fixed (corun / batch_invariant), or the sequence spread
    over ``num_splits`` splits rounded up to whole BLOCK_N tiles (default). Never below BLOCK_N so
    that a length-0 sequence divides safely (it has no split either way)."""
    if IS_FIXED_SPLIT:
        split_len = split_size
    else:
        split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    return tl.maximum(split_len, BLOCK_N)


@triton.jit
def _mla_decode_split_kernel(
    # pointers
    q_latent_ptr,
    q_pe_ptr,
    kv_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    mid_out_ptr,
    mid_lse_ptr,
    # sizes
    num_heads,
    latent_dim,
    rope_dim,
    block_size,
    split_size,
    num_splits,
    qk_scale,
    # strides
    stride_ql_b,
    stride_ql_h,
    stride_qp_b,
    stride_qp_h,
    stride_cache_b,
    stride_cache_t,
    stride_bt_b,
    stride_mo_b,
    stride_mo_h,
    stride_mo_s,
    stride_ml_b,
    stride_ml_h,
    # constexprs
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_R: tl.constexpr,
    IS_FIXED_SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Head blocks on the fastest grid axis: the programs that read the same cache tiles (one
    # sequence, one split, all head blocks) are scheduled together, so re-reads hit L2.
    pid_h = tl.program_id(0)
    pid_b = tl.program_id(1)
    pid_s = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + pid_b)
    split_len = _split_len(seq_len, split_size, num_splits, IS_FIXED_SPLIT, BLOCK_N)
    split_start = pid_s * split_len
    split_end = tl.minimum(split_start + split_len, seq_len)
    # The grid is sized for the longest allowed sequence; splits past this one's end do nothing.
    if split_start >= split_end:
        return

    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < num_heads
    offs_d = tl.arange(0, BLOCK_DV)
    mask_d = offs_d < latent_dim
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < rope_dim
    q_row = pid_b.to(tl.int64) * stride_ql_b + offs_h * stride_ql_h
    q = tl.load(
        q_latent_ptr + q_row[:, None] + offs_d[None, :],
        mask=mask_h[:, None] & mask_d[None, :],
        other=0.0,
    )
    qp_row = pid_b.to(tl.int64) * stride_qp_b + offs_h * stride_qp_h
    q_pe = tl.load(
        q_pe_ptr + qp_row[:, None] + offs_r[None, :],
        mask=mask_h[:, None] & mask_r[None, :],
        other=0.0,
    )
    if UPCAST:  # interpreter only: its bf16 tl.dot is wrong (kernels.utils.upcast_dot_operands)
        q = q.to(tl.float32)
        q_pe = q_pe.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    bt_ptr = block_tables_ptr + pid_b.to(tl.int64) * stride_bt_b
    for start_n in range(split_start, split_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < split_end
        blocks = tl.load(bt_ptr + offs_n // block_size, mask=mask_n, other=0).to(tl.int64)
        rows = blocks * stride_cache_b + (offs_n % block_size) * stride_cache_t
        # One load of the latent tile serves as both the key (with k_pe) and the value.
        c = tl.load(
            kv_cache_ptr + rows[:, None] + offs_d[None, :],
            mask=mask_n[:, None] & mask_d[None, :],
            other=0.0,
        )
        k_pe = tl.load(
            kv_cache_ptr + rows[:, None] + latent_dim + offs_r[None, :],
            mask=mask_n[:, None] & mask_r[None, :],
            other=0.0,
        )
        if UPCAST:
            c = c.to(tl.float32)
            k_pe = k_pe.to(tl.float32)
        qk = tl.dot(q, tl.trans(c), input_precision=DOT_PRECISION)
        qk += tl.dot(q_pe, tl.trans(k_pe), input_precision=DOT_PRECISION)
        qk = tl.where(mask_n[None, :], qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=DOT_PRECISION)
        m_i = m_new

    mo_ptr = mid_out_ptr + pid_b.to(tl.int64) * stride_mo_b + pid_s * stride_mo_s
    tl.store(
        mo_ptr + offs_h[:, None] * stride_mo_h + offs_d[None, :],
        acc / l_i[:, None],
        mask=mask_h[:, None] & mask_d[None, :],
    )
    ml_ptr = mid_lse_ptr + pid_b.to(tl.int64) * stride_ml_b + pid_s
    tl.store(ml_ptr + offs_h * stride_ml_h, m_i + tl.math.log2(l_i), mask=mask_h)


@triton.jit
def _mla_decode_combine_kernel(
    # pointers
    mid_out_ptr,
    mid_lse_ptr,
    seq_lens_ptr,
    out_ptr,
    # sizes
    latent_dim,
    split_size,
    num_splits,
    # strides
    stride_mo_b,
    stride_mo_h,
    stride_mo_s,
    stride_ml_b,
    stride_ml_h,
    stride_o_b,
    stride_o_h,
    # constexprs
    BLOCK_N: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    IS_FIXED_SPLIT: tl.constexpr,
):
    pid_b = tl.program_id(0)
    pid_h = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + pid_b)
    split_len = _split_len(seq_len, split_size, num_splits, IS_FIXED_SPLIT, BLOCK_N)
    num_valid = tl.cdiv(seq_len, split_len)  # 0 for an empty (dummy) sequence -> zeros

    offs_d = tl.arange(0, BLOCK_DV)
    mask_d = offs_d < latent_dim
    mo_ptr = mid_out_ptr + pid_b.to(tl.int64) * stride_mo_b + pid_h * stride_mo_h
    ml_ptr = mid_lse_ptr + pid_b.to(tl.int64) * stride_ml_b + pid_h * stride_ml_h
    e_max = -float("inf")
    e_sum = 0.0
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    # Split order 0, 1, 2, ...: the merge order is a function of the sequence's own splits only.
    for s in range(0, num_valid):
        lse = tl.load(ml_ptr + s)
        part = tl.load(mo_ptr + s * stride_mo_s + offs_d, mask=mask_d, other=0.0)
        new_max = tl.maximum(lse, e_max)
        old_scale = tl.math.exp2(e_max - new_max)
        weight = tl.math.exp2(lse - new_max)
        acc = acc * old_scale + weight * part
        e_sum = e_sum * old_scale + weight
        e_max = new_max
    out = tl.where(e_sum > 0.0, acc / tl.maximum(e_sum, 1e-30), 0.0)
    o_ptr = out_ptr + pid_b.to(tl.int64) * stride_o_b + pid_h * stride_o_h
    tl.store(o_ptr + offs_d, out.to(out_ptr.dtype.element_ty), mask=mask_d)


@triton.jit
def _mla_prefill_kernel(
    # pointers
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    cu_seqlens_q_ptr,
    cu_seqlens_k_ptr,
    # sizes
    qk_dim,
    v_dim,
    qk_scale,
    # strides
    stride_q_t,
    stride_q_h,
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_o_t,
    stride_o_h,
    # constexprs
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D1: tl.constexpr,
    BLOCK_D2: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_h = tl.program_id(1)
    pid_b = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + pid_b)
    q_len = tl.load(cu_seqlens_q_ptr + pid_b + 1) - q_start
    if pid_m * BLOCK_M >= q_len:  # the grid is sized for the longest chunk
        return
    k_start = tl.load(cu_seqlens_k_ptr + pid_b)
    k_len = tl.load(cu_seqlens_k_ptr + pid_b + 1) - k_start

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < q_len
    q_pos = k_len - q_len + offs_m  # bottom-right aligned causal position of each query row
    # qk head dim as two power-of-2 parts (192 = 128 + 64); BLOCK_D2 = 0 when it is one part.
    offs_d1 = tl.arange(0, BLOCK_D1)
    mask_d1 = offs_d1 < qk_dim
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < v_dim
    q_rows = (q_start + offs_m).to(tl.int64) * stride_q_t + pid_h * stride_q_h
    q1 = tl.load(
        q_ptr + q_rows[:, None] + offs_d1[None, :],
        mask=mask_m[:, None] & mask_d1[None, :],
        other=0.0,
    )
    if UPCAST:
        q1 = q1.to(tl.float32)
    if BLOCK_D2 > 0:
        offs_d2 = BLOCK_D1 + tl.arange(0, BLOCK_D2)
        mask_d2 = offs_d2 < qk_dim
        q2 = tl.load(
            q_ptr + q_rows[:, None] + offs_d2[None, :],
            mask=mask_m[:, None] & mask_d2[None, :],
            other=0.0,
        )
        if UPCAST:
            q2 = q2.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    # Keys up to this tile's last valid row position; always from key 0 in BLOCK_N steps.
    last_row = tl.minimum(q_len, (pid_m + 1) * BLOCK_M) - 1
    end_n = tl.minimum(k_len, k_len - q_len + last_row + 1)
    for start_n in range(0, end_n, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < k_len
        k_rows = (k_start + offs_n).to(tl.int64) * stride_k_t + pid_h * stride_k_h
        k1 = tl.load(
            k_ptr + k_rows[:, None] + offs_d1[None, :],
            mask=mask_n[:, None] & mask_d1[None, :],
            other=0.0,
        )
        if UPCAST:
            k1 = k1.to(tl.float32)
        qk = tl.dot(q1, tl.trans(k1), input_precision=DOT_PRECISION)
        if BLOCK_D2 > 0:
            k2 = tl.load(
                k_ptr + k_rows[:, None] + offs_d2[None, :],
                mask=mask_n[:, None] & mask_d2[None, :],
                other=0.0,
            )
            if UPCAST:
                k2 = k2.to(tl.float32)
            qk += tl.dot(q2, tl.trans(k2), input_precision=DOT_PRECISION)
        causal = (offs_n[None, :] <= q_pos[:, None]) & mask_n[None, :]
        qk = tl.where(causal, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_rows = (k_start + offs_n).to(tl.int64) * stride_v_t + pid_h * stride_v_h
        v = tl.load(
            v_ptr + v_rows[:, None] + offs_dv[None, :],
            mask=mask_n[:, None] & mask_dv[None, :],
            other=0.0,
        )
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    o_rows = (q_start + offs_m).to(tl.int64) * stride_o_t + pid_h * stride_o_h
    tl.store(
        out_ptr + o_rows[:, None] + offs_dv[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_dv[None, :],
    )
