"""Triton kernels of paged attention: causal prefill, split-KV decode and its combine.

The launchers, configs and policies live in ``kernels/attention.py``; this file holds only the
``@triton.jit`` code. Layouts: q [T or B, Hq, D]; K/V caches [num_blocks, block_size, Hkv, D];
block tables [B, max_blocks] int32. Every KV tile is gathered token by token through the block
table (``_paged_offsets``), so a sequence's blocks may sit anywhere in the cache.

**One computation per query row, whichever kernel runs it.** A query row at position p sees keys
[0, p]; both kernels cut them into splits of ``split_size`` keys starting at multiples of it, run
one online softmax per split over BLOCK_N-key tiles from the split's start (``_attend_tile``),
turn each split into a normalised fp32 partial and a log2-sum-exp (``_split_partial``), and fold
the splits in index order (``_combine_init`` / ``_combine_weights``); a row of one split is its
partial. Decode runs this for one query per sequence (its rows are the query heads of one kv
head, the splits spread over lanes and folded by a second launch or the last lane); prefill for a
tile of query positions of one head (the splits folded in registers as the tile walks the keys).
So a token's attention output has the same bits whether a decode step or a prefill chunk
computed it, provided the two run with the same split size and BLOCK_N:

- every reduction over keys is a ``tl.dot`` (the scores, P @ V, and the softmax denominator as
  P @ ones), whose row bits depend on the reduction's length and order only, not on the tile's
  row count: on the GPU that is the MMA (measured at the engine's shapes,
  ``tests/engine/test_gpu_engine.py``); under the interpreter, whose BLAS matmul is not row-
  invariant, the SERIAL_DOT product sums each element over K in order (``gemm_kernels._mma``).
  A ``tl.sum`` would reduce a row in an order set by the tile's register layout, which differs
  between a 16-row decode tile and a 128-row prefill tile;
- everything else is elementwise and written once here, so both kernels run one expression
  graph (masks are selects, never adds; the fold is explicit ``tl.fma``);
- a row that sees none of a tile's keys keeps its state exactly (a select), as if the tile were
  not visited, which is what decode does with keys past its sequence.

``split_size`` >= every context (the default mode's prefill) makes each row one split: one
online softmax from key 0. Decode's default-mode split size follows the batch, so there a token's
decode and prefill bits differ (the negative control).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.gemm_kernels import _mma

# exp2-based softmax: fold log2(e) into the scale once.
LOG2E = 1.4426950408889634
# Columns of the ones matrix the softmax denominator is summed against (tl.dot's minimum N).
ROWSUM_COLS = tl.constexpr(16)


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
def _attend_tile(acc, m_i, l_i, q, k, v, start_n, q_pos, qk_scale,
                 ROWS: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
                 SERIAL_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One online-softmax step of ``ROWS`` query rows over the keys [start_n, start_n + BLOCK_N).

    Row r sees the keys at or before its position q_pos[r] (scores of the others are selected to
    -inf, never masked by an add); a row that sees none of the tile's keys keeps (acc, m, l)
    exactly. k and v hold the tile's keys (rows a caller masked off load as zeros).
    """
    offs_n = start_n + tl.arange(0, BLOCK_N)
    scores = _mma(q, tl.trans(k), tl.zeros([ROWS, BLOCK_N], dtype=tl.float32), UPCAST,
                  SERIAL_DOT, DOT_PRECISION) * qk_scale
    # The select sits between the scale and the exponent's subtraction in every caller, so no
    # caller's compiler can fuse them into an FMA where another does not.
    scores = tl.where(offs_n[None, :] <= q_pos[:, None], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))  # a max is exact in any order
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None]).to(v.dtype)
    ones = tl.full([BLOCK_N, ROWSUM_COLS], 1.0, dtype=p.dtype)
    l_cols = tl.broadcast_to((l_i * alpha)[:, None], [ROWS, ROWSUM_COLS])
    l_new = tl.max(_mma(p, ones, l_cols, UPCAST, SERIAL_DOT, DOT_PRECISION), 1)
    acc_new = _mma(p, v, acc * alpha[:, None], UPCAST, SERIAL_DOT, DOT_PRECISION)
    live = start_n <= q_pos
    acc = tl.where(live[:, None], acc_new, acc)
    l_i = tl.where(live, l_new, l_i)
    m_i = tl.where(live, m_new, m_i)
    return acc, m_i, l_i


@triton.jit
def _fresh_state(ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """(acc, m, l) of an online softmax that has seen no key: a split's start."""
    return (tl.zeros([ROWS, BLOCK_D], dtype=tl.float32),
            tl.full([ROWS], float("-inf"), dtype=tl.float32), tl.zeros([ROWS], dtype=tl.float32))


@triton.jit
def _split_partial(acc, m_i, l_i):
    """A finished split's normalised fp32 partial output and its log2-sum-exp."""
    return acc / l_i[:, None], m_i + tl.log2(l_i)


@triton.jit
def _combine_init(part, lse):
    """The fold's state after a row's first split: (running max, sum of weighted partials,
    sum of weights) = (its lse, its partial, 1)."""
    return lse, part, tl.full(lse.shape, 1.0, dtype=tl.float32)


@triton.jit
def _combine_weights(m_c, lse):
    """Folding one more split into a row's state: the new running max, the factor that rescales
    the state and the weight of the new partial. The caller then computes
    ``acc = fma(part, weight, acc * rescale)`` and ``l = fma(l, rescale, weight)``."""
    m_new = tl.maximum(m_c, lse)
    return m_new, tl.exp2(m_c - m_new), tl.exp2(lse - m_new)


@triton.jit
def _prefill_attention_kernel(
    # pointers
    q_ptr, k_cache_ptr, v_cache_ptr, o_ptr, block_tables_ptr, cu_seqlens_q_ptr, context_lens_ptr,
    # sizes
    num_tokens, num_seqs, num_m_tiles, group_size, block_size, split_size, qk_scale,
    # strides
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    stride_cb, stride_co, stride_ch,
    # constexprs
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, SERIAL_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One program per (q head, query tile, sequence): causal attention over the cache, each
    row's keys in splits of ``split_size`` folded in order (module docstring). The extra
    sequence index ``num_seqs`` zeroes the padding rows after cu_seqlens_q[-1]."""
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

    table_row_ptr = block_tables_ptr + pid_b.to(tl.int64) * stride_bt
    kv_head_off = (pid_h // group_size).to(tl.int64) * stride_ch
    acc, m_i, l_i = _fresh_state(BLOCK_M, BLOCK_D)
    # The fold of the finished splits (set by split 0, which every row sees: key 0 is in it).
    m_c = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_c = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc_c = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    keys_end = tl.minimum(first_pos + (pid_m + 1) * BLOCK_M, kv_len)  # the tile's last row + 1
    for start_n in range(0, keys_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_len
        kv_off = _paged_offsets(table_row_ptr, offs_n, n_mask, block_size, stride_cb, stride_co)
        kv_off = kv_off[:, None] + kv_head_off + offs_d[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=n_mask[:, None], other=0.0)
        v = tl.load(v_cache_ptr + kv_off, mask=n_mask[:, None], other=0.0)
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k, v, start_n, q_pos, qk_scale,
                                     BLOCK_M, BLOCK_N, UPCAST, SERIAL_DOT, DOT_PRECISION)
        tile_end = start_n + BLOCK_N
        if (tile_end % split_size == 0) | (tile_end >= keys_end):  # a split's last tile
            split_start = start_n - start_n % split_size
            part, lse = _split_partial(acc, m_i, l_i)
            if split_start == 0:
                m_c, acc_c, l_c = _combine_init(part, lse)
            else:
                m_new, rescale, weight = _combine_weights(m_c, lse)
                sees = split_start <= q_pos  # rows whose keys reach into this split
                acc_c = tl.where(sees[:, None],
                                 tl.fma(part, weight[:, None], acc_c * rescale[:, None]), acc_c)
                l_c = tl.where(sees, tl.fma(l_c, rescale, weight), l_c)
                m_c = tl.where(sees, m_new, m_c)
            acc, m_i, l_i = _fresh_state(BLOCK_M, BLOCK_D)
    # A row of one split is its partial (as decode writes it); a longer one its fold.
    out = tl.where((q_pos < split_size)[:, None], acc_c, acc_c / l_c[:, None])
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
    BLOCK_D: tl.constexpr, UPCAST: tl.constexpr, SERIAL_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FUSED_COMBINE: tl.constexpr, GPU_FENCE: tl.constexpr,
    LANE_PAGES: tl.constexpr,
):
    """Stage 1: one program per (sequence, kv head, lane). The lane takes a contiguous run of the
    sequence's splits (lane l of L: splits l*n//L .. (l+1)*n//L - 1 of its n) and walks their
    tokens in one loop, so the software pipeline runs across split boundaries; at each boundary it
    writes the split's normalised fp32 partial and log2-sum-exp (``_split_partial``), which depend
    only on the split's tokens, never on the lane. A sequence of one split writes its output
    directly instead (no partial round trip; stage 2 skips it); a sequence of length 0 gets zeros.
    split_size is a multiple of BLOCK_N, so no KV tile straddles two splits.

    FUSED_COMBINE (one launch, no stage 2): each lane, once its partials are written, counts its
    arrival in ``arrivals[b, kv head]``; the last of the min(lanes, splits) lanes to arrive
    folds the kv head's query heads with ``_combine_splits``, as stage 2 would (the same bits:
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
    # Every head row is the sequence's one query, at position seq_len - 1.
    q_pos = tl.full([BLOCK_H], 0, dtype=tl.int32) + (seq_len - 1)
    table_row_ptr = block_tables_ptr + pid_b.to(tl.int64) * stride_bt
    kv_head_off = pid_kvh.to(tl.int64) * stride_ch
    mid_o_ptrs = (mid_o_ptr + pid_b.to(tl.int64) * stride_mb + heads[:, None] * stride_mh
                  + offs_d[None, :])
    mid_lse_ptrs = mid_lse_ptr + pid_b.to(tl.int64) * stride_lb + heads * stride_lh

    acc, m_i, l_i = _fresh_state(BLOCK_H, BLOCK_D)
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
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k, v, start_n, q_pos, qk_scale,
                                     BLOCK_H, BLOCK_N, UPCAST, SERIAL_DOT, DOT_PRECISION)
        tile_end = start_n + BLOCK_N
        if (tile_end % split_size == 0) | (tile_end >= end):  # the last tile of a split
            part, lse = _split_partial(acc, m_i, l_i)
            if num_splits == 1:
                tl.store(o_ptrs, part.to(o_ptr.dtype.element_ty), mask=h_mask[:, None])
            else:
                split = start_n // split_size
                tl.store(mid_o_ptrs + split * stride_ms, part, mask=h_mask[:, None])
                tl.store(mid_lse_ptrs + split, lse, mask=h_mask)
            acc, m_i, l_i = _fresh_state(BLOCK_H, BLOCK_D)
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
                        num_splits, BLOCK_D, stride_ms, BLOCK_D)
                tl.atomic_xchg(arrivals, 0, sem="relaxed", scope="gpu")


@triton.jit
def _fence_acq_rel_gpu():
    """Each thread's ``fence.acq_rel.gpu`` (CUDA's __threadfence()); GPU builds only."""
    tl.inline_asm_elementwise("fence.acq_rel.gpu; // $0", "=r", [], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _combine_splits(
    mid_o_head_ptr, mid_lse_head_ptr, out_head_ptr, num_splits, head_dim, stride_ms,
    BLOCK_D: tl.constexpr,
):
    """One query head's splits (two or more) -> its output: the fold of ``_combine_init`` and
    ``_combine_weights`` in split order, as the prefill kernel folds a row's splits in
    registers. Elementwise only, no reduction across threads: the bits depend only on the
    partials, not on the program's layout or warp count, so the combine kernel and the split
    kernel's fused combine (different warp counts) give the same output. The partials make an
    exact fp32 round trip through memory (".cg": L2, where another lane wrote them)."""
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    # Scalars as one-element vectors: the fold is the prefill kernel's row-vector code.
    one = tl.arange(0, 1)
    lse = tl.load(mid_lse_head_ptr + one, cache_modifier=".cg")
    part = tl.load(mid_o_head_ptr + offs_d[None, :], mask=d_mask[None, :], other=0.0,
                   cache_modifier=".cg")
    m_c, acc_c, l_c = _combine_init(part, lse)
    for split in range(1, num_splits):
        lse = tl.load(mid_lse_head_ptr + split + one, cache_modifier=".cg")
        part = tl.load(mid_o_head_ptr + split * stride_ms + offs_d[None, :], mask=d_mask[None, :],
                       other=0.0, cache_modifier=".cg")
        m_c, rescale, weight = _combine_weights(m_c, lse)
        acc_c = tl.fma(part, weight[:, None], acc_c * rescale[:, None])
        l_c = tl.fma(l_c, rescale, weight)
    out = acc_c / l_c[:, None]
    tl.store(out_head_ptr + offs_d[None, :], out.to(out_head_ptr.dtype.element_ty),
             mask=d_mask[None, :])


@triton.jit
def _decode_combine_kernel(
    # pointers
    mid_o_ptr, mid_lse_ptr, seq_lens_ptr, o_ptr,
    # sizes
    head_dim, split_size,
    # strides
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_ob, stride_oh,
    # constexprs
    BLOCK_D: tl.constexpr,
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
                    num_splits, head_dim, stride_ms, BLOCK_D)
