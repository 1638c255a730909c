"""Triton kernels of paged attention: causal prefill, split-KV decode and its combine.

The launchers, configs and policies live in ``kernels/attention.py``; this file holds only the
``@triton.jit`` code. Layouts: q [T or B, Hq, D]; K/V caches [num_blocks, block_size, Hkv, D];
block tables [B, max_blocks] int32. Every KV tile is gathered token by token through the block
table (``_paged_offsets``), so a sequence's blocks may sit anywhere in the cache.

Invariance comes from the loop structure, not from special arithmetic:
- prefill: every query row walks the KV tiles [0, BLOCK_N), [BLOCK_N, 2 BLOCK_N), ... from key 0,
  whatever query tile it sits in, and tiles that are fully masked for a row leave its state
  bit-for-bit unchanged (``_prefill_tile``), so a row's bits depend only on its own position, the
  keys it can see and (through the dot units) its offset inside the query tile.
- decode: a split is split_size consecutive tokens of one sequence starting at a multiple of
  split_size (a runtime argument, a multiple of BLOCK_N: default mode's size changes with the
  batch and must not trigger recompiles); its partial result depends only on that sequence,
  and the combine folds the splits in index order.
"""

from __future__ import annotations

import triton
import triton.language as tl

# exp2-based softmax: fold log2(e) into the scale once.
LOG2E = 1.4426950408889634


@triton.jit
def _paged_offsets(table_row_ptr, tokens, token_mask, block_size, stride_cb, stride_co):
    """Element offsets (int64) of ``tokens`` of one sequence in a paged cache (head 0, dim 0)."""
    page = tl.load(table_row_ptr + tokens // block_size, mask=token_mask, other=0).to(tl.int64)
    return _token_offsets(page, tokens, block_size, stride_cb, stride_co)


@triton.jit
def _token_offsets(page, tokens, block_size, stride_cb, stride_co):
    """Element offsets (int64) of ``tokens`` whose block ids (int64) are ``page``."""
    return page * stride_cb + (tokens % block_size).to(tl.int64) * stride_co


@triton.jit
def _preload_block_ids(table_row_ptr, first_page, end_token, page_size, PAGES: tl.constexpr):
    """The block ids of pages first_page .. first_page + PAGES - 1 of one sequence (pages at or
    past cdiv(end_token, page_size), which hold no token before ``end_token``, read as 0):
    loaded once, before a token loop, so that no tile's address waits on a load inside it."""
    pages = first_page + tl.arange(0, PAGES)
    return tl.load(table_row_ptr + pages, mask=pages < tl.cdiv(end_token, page_size), other=0)


@triton.jit
def _preloaded_block(block_ids, first_page, tokens, page_size, PAGES: tl.constexpr):
    """The block id (int64) of each of ``tokens`` from ``_preload_block_ids``'s ids. Tokens past
    the run's end (masked by the caller) get their page's id, 0, or, beyond the PAGES loaded,
    the last one: in range either way, never read."""
    page = tl.minimum(tokens // page_size - first_page, PAGES - 1)
    return tl.gather(block_ids, page, 0).to(tl.int64)


@triton.jit
def _zero_padding_rows(o_ptr, first_row, num_tokens, lane, num_lanes, col_off, dim, stride_ot,
                       BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """Write zeros to rows [first_row, num_tokens), columns [col_off, col_off + dim) of the
    output: the padding rows of a packed step, which belong to no sequence (shared with
    kernels/mla_kernels.py). Lane ``lane`` of ``num_lanes`` takes every num_lanes-th row tile."""
    offs_d = tl.arange(0, BLOCK_D)
    zeros = tl.zeros([BLOCK_M, BLOCK_D], dtype=o_ptr.dtype.element_ty)
    for start in range(first_row + lane * BLOCK_M, num_tokens, num_lanes * BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        tl.store(o_ptr + rows.to(tl.int64)[:, None] * stride_ot + col_off + offs_d[None, :],
                 zeros, mask=(rows < num_tokens)[:, None] & (offs_d < dim)[None, :])


@triton.jit
def _prefill_tile(
    acc, m_i, l_i, q, q_pos,
    k_cache_ptr, v_cache_ptr, table_row_ptr, kv_head_off, start_n, kv_len,
    block_size, stride_cb, stride_co, qk_scale,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step over keys [start_n, start_n + BLOCK_N).

    MASKED=False is only used for tiles every row of the query tile fully sees; it computes the
    same bits as MASKED=True does for such rows (the mask is a select on the raw scores, never an
    add, and the rest of the arithmetic is the same expression graph).
    """
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_mask = offs_n < kv_len
    if MASKED:
        kv_off = _paged_offsets(table_row_ptr, offs_n, n_mask, block_size, stride_cb, stride_co)
        kv_off = kv_off[:, None] + kv_head_off + offs_d[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=n_mask[:, None], other=0.0)
        v = tl.load(v_cache_ptr + kv_off, mask=n_mask[:, None], other=0.0)
    else:  # every key of the tile is < kv_len: unmasked loads
        page = tl.load(table_row_ptr + offs_n // block_size).to(tl.int64)
        kv_off = page * stride_cb + (offs_n % block_size).to(tl.int64) * stride_co
        kv_off = kv_off[:, None] + kv_head_off + offs_d[None, :]
        k = tl.load(k_cache_ptr + kv_off)
        v = tl.load(v_cache_ptr + kv_off)
    if UPCAST:
        k = k.to(tl.float32)
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if MASKED:
        # Mask the raw scores, before the scale: then both variants compute the same
        # `scores * qk_scale - m` expression (one FMA under Triton's default fp fusion).
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        scores = tl.where(visible, scores, float("-inf"))
    # The row max of the raw scores, scaled once: rounding is monotone and qk_scale > 0 (the
    # launcher checks it), so it is the max of the scaled scores bit for bit, without a multiply
    # per score for the max alone.
    m_new = tl.maximum(m_i, tl.max(scores, 1) * qk_scale)
    # m_new is finite: key 0 is visible to every row and is in the first tile each row walks.
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores * qk_scale - m_new[:, None])
    l_new = l_i * alpha + tl.sum(p, 1)
    p_dot = p.to(v.dtype)
    if UPCAST:
        p_dot = p_dot.to(tl.float32)
        v = v.to(tl.float32)
    acc_new = tl.dot(p_dot, v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    if MASKED:
        # A row that sees no key of this tile keeps its state exactly: adding the all-zero
        # product would still turn an accumulated -0.0 into +0.0.
        live = start_n <= q_pos
        acc_new = tl.where(live[:, None], acc_new, acc)
        l_new = tl.where(live, l_new, l_i)
        m_new = tl.where(live, m_new, m_i)
    return acc_new, m_new, l_new


@triton.jit
def _prefill_attention_kernel(
    # pointers
    q_ptr, k_cache_ptr, v_cache_ptr, o_ptr, block_tables_ptr, cu_seqlens_q_ptr, context_lens_ptr,
    # sizes
    num_tokens, num_seqs, num_m_tiles, group_size, block_size, qk_scale,
    # strides
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    stride_cb, stride_co, stride_ch,
    # constexprs
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One program per (q head, query tile, sequence): causal flash attention over the cache.
    The extra sequence index ``num_seqs`` zeroes the padding rows after cu_seqlens_q[-1]."""
    pid_h = tl.program_id(0)
    # Heaviest (last) query tiles first: causal work grows with the tile index.
    pid_m = num_m_tiles - 1 - tl.program_id(1)
    pid_b = tl.program_id(2)
    if pid_b == num_seqs:
        _zero_padding_rows(o_ptr, tl.load(cu_seqlens_q_ptr + num_seqs), num_tokens, pid_m,
                           num_m_tiles, pid_h * stride_oh, BLOCK_D, stride_ot, BLOCK_M, BLOCK_D)
        return
    q_start = tl.load(cu_seqlens_q_ptr + pid_b)
    q_len = tl.load(cu_seqlens_q_ptr + pid_b + 1) - q_start
    if pid_m * BLOCK_M >= q_len:
        return
    kv_len = tl.load(context_lens_ptr + pid_b)
    first_pos = kv_len - q_len  # position of the chunk's first query

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    q_pos = first_pos + offs_m
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + pid_h * stride_qh + offs_d[None, :],
        mask=m_mask[:, None], other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    table_row_ptr = block_tables_ptr + pid_b.to(tl.int64) * stride_bt
    kv_head_off = (pid_h // group_size).to(tl.int64) * stride_ch
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    tile_first_pos = first_pos + pid_m * BLOCK_M
    tile_last_pos = tl.minimum(first_pos + (pid_m + 1) * BLOCK_M, kv_len) - 1
    # Tiles wholly at or below the tile's first query position: every row sees every key.
    full_end = ((tile_first_pos + 1) // BLOCK_N) * BLOCK_N
    for start_n in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _prefill_tile(
            acc, m_i, l_i, q, q_pos, k_cache_ptr, v_cache_ptr, table_row_ptr, kv_head_off,
            start_n, kv_len, block_size, stride_cb, stride_co, qk_scale,
            BLOCK_N, BLOCK_D, False, UPCAST, DOT_PRECISION,
        )
    # The diagonal tiles, with the causal and length mask.
    for start_n in range(full_end, tile_last_pos + 1, BLOCK_N):
        acc, m_i, l_i = _prefill_tile(
            acc, m_i, l_i, q, q_pos, k_cache_ptr, v_cache_ptr, table_row_ptr, kv_head_off,
            start_n, kv_len, block_size, stride_cb, stride_co, qk_scale,
            BLOCK_N, BLOCK_D, True, UPCAST, DOT_PRECISION,
        )
    out = acc / l_i[:, None]
    tl.store(
        o_ptr + q_rows[:, None] * stride_ot + pid_h * stride_oh + offs_d[None, :],
        out.to(o_ptr.dtype.element_ty), mask=m_mask[:, None],
    )


@triton.jit
def _decode_split_kernel(
    # pointers
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, o_ptr, mid_o_ptr, mid_lse_ptr,
    arrivals_ptr,
    # sizes
    group_size, block_size, split_size, num_lanes, qk_scale,
    # strides
    stride_qb, stride_qh, stride_ob, stride_oh, stride_bt, stride_cb, stride_co, stride_ch,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
    # constexprs
    BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FUSED_COMBINE: tl.constexpr, COMBINE_BLOCK_S: tl.constexpr, GPU_FENCE: tl.constexpr,
    LANE_PAGES: tl.constexpr,
):
    """Stage 1: one program per (sequence, kv head, lane). The lane takes a contiguous run of the
    sequence's splits (lane l of L: splits l*n//L .. (l+1)*n//L - 1 of its n) and walks their
    tokens in one loop, so the software pipeline runs across split boundaries; at each boundary it
    writes the split's normalised fp32 partial and log2-sum-exp, which depend only on the split's
    tokens, never on the lane. A sequence of one split writes its output directly instead (no
    partial round trip; stage 2 skips it); a sequence of length 0 gets zeros. split_size is a
    multiple of BLOCK_N, so no KV tile straddles two splits.

    FUSED_COMBINE (one launch, no stage 2): each lane, once its partials are written, counts its
    arrival in ``arrivals[b, kv head]``; the last of the min(lanes, splits) lanes to arrive
    combines the kv head's query heads with ``_combine_splits``, as stage 2 would (the same bits:
    split order, whichever lane is last), and sets the count back to 0 for the next call.

    LANE_PAGES > 0 (at most that many pages a lane): the lane's block ids are loaded before its
    token loop and each tile gathers its own from them. Loaded tile by tile, each K/V tile's
    address waits on a table load inside the loop, and the compiled loop (sm_90a, Triton 3.6)
    keeps one K and one V buffer and waits for them at every step; preloaded, the next tile's
    copies can be in flight during this tile's products. The same rows reach the same dots."""
    pid_b = tl.program_id(0)
    pid_kvh = tl.program_id(1)
    pid_s = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + pid_b)
    num_splits = tl.cdiv(seq_len, split_size)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < group_size
    heads = pid_kvh * group_size + offs_h  # the query heads sharing this kv head
    o_ptrs = (o_ptr + pid_b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh
              + offs_d[None, :])
    if seq_len == 0:  # a dummy slot: zeros, written by lane 0
        if pid_s == 0:
            tl.store(o_ptrs, tl.zeros([BLOCK_H, BLOCK_D], dtype=o_ptr.dtype.element_ty),
                     mask=h_mask[:, None])
        return
    first = (pid_s * num_splits) // num_lanes
    last = ((pid_s + 1) * num_splits) // num_lanes
    if first >= last:  # fewer splits than lanes: this lane has none
        return
    end = tl.minimum(last * split_size, seq_len)
    q = tl.load(
        q_ptr + pid_b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=h_mask[:, None], other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    table_row_ptr = block_tables_ptr + pid_b.to(tl.int64) * stride_bt
    kv_head_off = pid_kvh.to(tl.int64) * stride_ch
    mid_o_ptrs = (mid_o_ptr + pid_b.to(tl.int64) * stride_mb + heads[:, None] * stride_mh
                  + offs_d[None, :])
    mid_lse_ptrs = mid_lse_ptr + pid_b.to(tl.int64) * stride_lb + heads * stride_lh

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    if LANE_PAGES > 0:
        first_page = (first * split_size) // block_size
        lane_ids = _preload_block_ids(table_row_ptr, first_page, end, block_size, LANE_PAGES)
    for start_n in range(first * split_size, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        if LANE_PAGES > 0:
            page = _preloaded_block(lane_ids, first_page, offs_n, block_size, LANE_PAGES)
            kv_off = _token_offsets(page, offs_n, block_size, stride_cb, stride_co)
        else:
            kv_off = _paged_offsets(table_row_ptr, offs_n, n_mask, block_size, stride_cb,
                                    stride_co)
        kv_off = kv_off[:, None] + kv_head_off + offs_d[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=n_mask[:, None], other=0.0)
        v = tl.load(v_cache_ptr + kv_off, mask=n_mask[:, None], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))  # finite: a tile's first token is always real
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        p_dot = p.to(v.dtype)
        if UPCAST:
            p_dot = p_dot.to(tl.float32)
            v = v.to(tl.float32)
        acc = tl.dot(p_dot, v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
        tile_end = start_n + BLOCK_N
        if (tile_end % split_size == 0) | (tile_end >= end):  # the last tile of a split
            if num_splits == 1:
                tl.store(o_ptrs, (acc / l_i[:, None]).to(o_ptr.dtype.element_ty),
                         mask=h_mask[:, None])
            else:
                split = start_n // split_size
                tl.store(mid_o_ptrs + split * stride_ms, acc / l_i[:, None], mask=h_mask[:, None])
                tl.store(mid_lse_ptrs + split, m_i + tl.log2(l_i), mask=h_mask)
            m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
            acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    if FUSED_COMBINE:
        if num_splits > 1:
            # CUDA's threadFenceReduction order: every thread fences its partial stores, the
            # block syncs, then one thread takes the ticket (acq_rel); the last lane's threads
            # fence again before they read the other lanes' partials (L2 loads, ".cg").
            if GPU_FENCE:
                _fence_acq_rel_gpu()
            tl.debug_barrier()
            arrivals = arrivals_ptr + pid_b * tl.num_programs(1) + pid_kvh
            arrived = tl.atomic_add(arrivals, 1, sem="acq_rel", scope="gpu")
            if arrived == tl.minimum(num_lanes, num_splits) - 1:
                if GPU_FENCE:
                    _fence_acq_rel_gpu()
                for h in range(group_size):
                    head = pid_kvh * group_size + h
                    _combine_splits(
                        mid_o_ptr + pid_b.to(tl.int64) * stride_mb + head * stride_mh,
                        mid_lse_ptr + pid_b.to(tl.int64) * stride_lb + head * stride_lh,
                        o_ptr + pid_b.to(tl.int64) * stride_ob + head * stride_oh,
                        num_splits, BLOCK_D, stride_ms, COMBINE_BLOCK_S, BLOCK_D)
                tl.atomic_xchg(arrivals, 0, sem="relaxed", scope="gpu")


@triton.jit
def _fence_acq_rel_gpu():
    """Each thread's ``fence.acq_rel.gpu`` (CUDA's __threadfence()); GPU builds only."""
    tl.inline_asm_elementwise("fence.acq_rel.gpu; // $0", "=r", [], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _combine_splits(
    mid_o_head_ptr, mid_lse_head_ptr, out_head_ptr, num_splits, head_dim, stride_ms,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One query head's splits -> its output: sum_s w_s o_s / sum_s w_s, w_s = exp2(lse_s - max).

    The splits are added one at a time in index order, each an elementwise multiply-add, with no
    reduction across threads: the bits depend only on the splits, not on the program's layout
    or warp count, so the combine kernel and the split kernel's fused combine (different warp
    counts) give the same output. BLOCK_S splits are loaded per unrolled step, so their loads do
    not wait on the previous split's sums."""
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    m_max = tl.full([BLOCK_S], float("-inf"), dtype=tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):  # the max is exact in any order
        lse = tl.load(mid_lse_head_ptr + s0 + offs_s, mask=s0 + offs_s < num_splits,
                      other=float("-inf"), cache_modifier=".cg")
        m_max = tl.maximum(m_max, lse)
    m = tl.max(m_max, 0)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    l_sum = tl.zeros([], dtype=tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        for j in tl.static_range(BLOCK_S):
            # Past the last split: its partial is masked off (0, no memory traffic) and its
            # weight is 0, so it adds an exact zero. The scalar lse load is clamped to a real
            # split instead of masked (the interpreter has no scalar masks), and the vector
            # mask is built as a tensor for the same reason.
            split = tl.minimum(s0 + j, num_splits - 1)
            lse = tl.load(mid_lse_head_ptr + split, cache_modifier=".cg")
            in_range = d_mask & (offs_d * 0 + s0 + j < num_splits)
            part = tl.load(mid_o_head_ptr + split * stride_ms + offs_d, mask=in_range, other=0.0,
                           cache_modifier=".cg")
            weight = tl.where(s0 + j < num_splits, tl.exp2(lse - m), 0.0)
            acc += weight * part
            l_sum += weight
    tl.store(out_head_ptr + offs_d, (acc / l_sum).to(out_head_ptr.dtype.element_ty), mask=d_mask)


@triton.jit
def _decode_combine_kernel(
    # pointers
    mid_o_ptr, mid_lse_ptr, seq_lens_ptr, o_ptr,
    # sizes
    head_dim, split_size,
    # strides
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_ob, stride_oh,
    # constexprs
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Stage 2: one program per (sequence, q head) with two or more splits (``_combine_splits``),
    so the result depends only on the sequence's own splits."""
    pid_b = tl.program_id(0)
    pid_h = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + pid_b)
    num_splits = tl.cdiv(seq_len, split_size)
    if num_splits <= 1:  # written by stage 1 (one split) or a dummy slot (zeros)
        return
    _combine_splits(mid_o_ptr + pid_b.to(tl.int64) * stride_mb + pid_h * stride_mh,
                    mid_lse_ptr + pid_b.to(tl.int64) * stride_lb + pid_h * stride_lh,
                    o_ptr + pid_b.to(tl.int64) * stride_ob + pid_h * stride_oh,
                    num_splits, head_dim, stride_ms, BLOCK_S, BLOCK_D)
