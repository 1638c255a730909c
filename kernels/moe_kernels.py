"""Triton kernels of the routed-expert layer. The router launchers are in ``moe_routing.py``; the
expert GEMM and combine launchers and their tile policy are in ``moe.py``.

- ``_softmax_topk_kernel`` / ``_grouped_topk_kernel``: one token per program; top-k by iterative
  argmax (lowest expert id on ties), so a token's routing is a function of its own logits only.
- ``_moe_gate_up_kernel`` / ``_moe_down_kernel``: grouped GEMMs over the (token, rank) pairs
  sorted by expert and padded to BLOCK_M per expert. A program owns one BLOCK_M block of one
  expert and one BLOCK_N column tile, and walks K in BLOCK_K steps from 0: no split-K, so a row's
  reduction order depends on BLOCK_K and K only, never on its block neighbours. Under the
  interpreter the SERIAL_DOT constexpr (off on GPUs) replaces ``tl.dot`` with a row-order-free
  sum, since the interpreter's numpy dot is not position-invariant within a tile.
- ``_moe_combine_kernel``: out[t] = sum over ranks 0..k-1 (that order) of w[t, r] * y[t*k + r],
  in fp32, one store; no atomics.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _argmax_lowest(values, offs, SENTINEL: tl.constexpr):
    """(max, lowest index holding it) of a 1-D block; ties go to the lowest expert id."""
    best = tl.max(values, axis=0)
    idx = tl.min(tl.where(values == best, offs, SENTINEL), axis=0)
    return best, idx


@triton.jit
def _tile_dot_serial(a, b):
    """[M, K] x [K, N] -> fp32 [M, N] as a broadcast product summed over the tile's K.

    Interpreter only (SERIAL_DOT): its tl.dot is numpy's BLAS matmul, whose FMA order for a row
    depends on the row's slot in the BLAS micro-tile, so a pair's bits would depend on where it
    lands in its expert's BLOCK_M block (measured: a shared prefill step of tiny-deepseek-v3 gave
    the same rows other bits). This sum is the same for every row, as the GPU's MMA is, and like
    the BLAS path it still depends on BLOCK_K (the GEMM kernel's SERIAL_DOT does the same).
    """
    prod = a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :]
    return tl.sum(prod, axis=1)


@triton.jit
def _softmax_topk_kernel(
    # pointers
    logits_ptr, weights_ptr, ids_ptr,
    # sizes
    num_experts,
    # strides
    stride_lt, stride_wt, stride_it,
    # meta
    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_t = tl.program_id(0).to(tl.int64)
    offs_e = tl.arange(0, BLOCK_E)
    mask_e = offs_e < num_experts
    logits = tl.load(logits_ptr + pid_t * stride_lt + offs_e, mask=mask_e, other=-float("inf"))
    logits = logits.to(tl.float32)
    numer = tl.exp(logits - tl.max(logits, axis=0))
    numer = tl.where(mask_e, numer, 0.0)
    probs = numer / tl.sum(numer, axis=0)

    offs_k = tl.arange(0, BLOCK_K)
    top_w = tl.zeros([BLOCK_K], dtype=tl.float32)
    top_i = tl.zeros([BLOCK_K], dtype=tl.int32)
    cand = tl.where(mask_e, probs, -float("inf"))
    for r in tl.static_range(TOP_K):
        best, idx = _argmax_lowest(cand, offs_e, BLOCK_E)
        top_w = tl.where(offs_k == r, best, top_w)
        top_i = tl.where(offs_k == r, idx, top_i)
        cand = tl.where(offs_e == idx, -float("inf"), cand)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, axis=0)  # lanes >= TOP_K hold 0
    mask_k = offs_k < TOP_K
    tl.store(weights_ptr + pid_t * stride_wt + offs_k, top_w, mask=mask_k)
    tl.store(ids_ptr + pid_t * stride_it + offs_k, top_i, mask=mask_k)


@triton.jit
def _grouped_topk_kernel(
    # pointers
    logits_ptr, bias_ptr, weights_ptr, ids_ptr,
    # sizes
    n_group, group_size, routed_scaling_factor,
    # strides
    stride_lt, stride_wt, stride_it,
    # meta
    TOP_K: tl.constexpr, TOPK_GROUP: tl.constexpr, RENORMALIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_GS: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_t = tl.program_id(0).to(tl.int64)
    offs_g = tl.arange(0, BLOCK_G)
    offs_j = tl.arange(0, BLOCK_GS)
    # the token's experts as a [group, expert-in-group] tile; flat = expert id
    flat = offs_g[:, None] * group_size + offs_j[None, :]
    mask = (offs_g[:, None] < n_group) & (offs_j[None, :] < group_size)
    logits = tl.load(logits_ptr + pid_t * stride_lt + flat, mask=mask, other=0.0).to(tl.float32)
    scores = tl.sigmoid(logits)
    bias = tl.load(bias_ptr + flat, mask=mask, other=0.0).to(tl.float32)
    # the correction bias steers the choice only; the weights come from the unbiased scores
    choice = tl.where(mask, scores + bias, -float("inf"))

    # group score = top-1 + top-2 of the group (top-2 found by masking the top-1's lowest index)
    top1 = tl.max(choice, axis=1)
    idx1 = tl.min(tl.where(choice == top1[:, None], offs_j[None, :], BLOCK_GS), axis=1)
    top2 = tl.max(tl.where(offs_j[None, :] == idx1[:, None], -float("inf"), choice), axis=1)
    group_cand = tl.where(offs_g < n_group, top1 + top2, -float("inf"))
    keep = offs_g < 0
    for _ in tl.static_range(TOPK_GROUP):
        _best, gidx = _argmax_lowest(group_cand, offs_g, BLOCK_G)
        keep = keep | (offs_g == gidx)
        group_cand = tl.where(offs_g == gidx, -float("inf"), group_cand)
    cand = tl.where(keep[:, None] & mask, choice, -float("inf"))

    offs_k = tl.arange(0, BLOCK_K)
    top_w = tl.zeros([BLOCK_K], dtype=tl.float32)
    top_i = tl.zeros([BLOCK_K], dtype=tl.int32)
    for r in tl.static_range(TOP_K):
        best = tl.max(tl.max(cand, axis=1), axis=0)
        hit = tl.where(cand == best, flat, BLOCK_G * BLOCK_GS)
        idx = tl.min(tl.min(hit, axis=1), axis=0)
        # masked: a padding lane of a group narrower than BLOCK_GS has the flat id of an expert
        # of the next group (and the score of a zero logit)
        weight = tl.sum(tl.sum(tl.where(mask & (flat == idx), scores, 0.0), axis=1), axis=0)
        top_w = tl.where(offs_k == r, weight, top_w)
        top_i = tl.where(offs_k == r, idx, top_i)
        cand = tl.where(flat == idx, -float("inf"), cand)
    if RENORMALIZE:
        top_w = top_w / (tl.sum(top_w, axis=0) + 1e-20)
    top_w = top_w * routed_scaling_factor
    mask_k = offs_k < TOP_K
    tl.store(weights_ptr + pid_t * stride_wt + offs_k, top_w, mask=mask_k)
    tl.store(ids_ptr + pid_t * stride_it + offs_k, top_i, mask=mask_k)


@triton.jit
def _moe_gate_up_kernel(
    # pointers
    x_ptr, w13_ptr, act_ptr, sorted_pair_ids_ptr, block_expert_ids_ptr,
    # sizes
    num_pairs, hidden, inter,
    # strides
    stride_xt, stride_we, stride_wn, stride_wk, stride_ap,
    # meta
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, UPCAST: tl.constexpr, SERIAL_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """act[pair, n] = silu(x_t . w13[e, n]) * (x_t . w13[e, I + n]) for n in this column tile."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ids_ptr + pid_m)
    if expert < 0:  # a block past the last expert's padded rows: nothing to do
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pair_ids_ptr + offs_m)
    mask_m = pair < num_pairs  # padding rows hold the sentinel num_pairs
    token = (pair // TOP_K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)

    x_ptrs = x_ptr + token[:, None] * stride_xt + offs_k[None, :]
    # int64: DeepSeek-V3's w13 has 7.5e9 elements
    w_base = w13_ptr + expert.to(tl.int64) * stride_we
    wg_ptrs = w_base + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk
    wu_ptrs = wg_ptrs + inter * stride_wn  # up rows follow the I gate rows

    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        # EVEN_K drops the K mask so the weight loads vectorize along K; masked lanes would be
        # zeros, so the sum (and its bits) is the same either way
        if EVEN_K:
            a = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
            b_gate = tl.load(wg_ptrs, mask=mask_n[None, :], other=0.0)
            b_up = tl.load(wu_ptrs, mask=mask_n[None, :], other=0.0)
        else:
            mask_k = offs_k < hidden - k0
            a = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            b_gate = tl.load(wg_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            b_up = tl.load(wu_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if UPCAST:  # interpreter only: its bf16 tl.dot is wrong
            a = a.to(tl.float32)
            b_gate = b_gate.to(tl.float32)
            b_up = b_up.to(tl.float32)
        if SERIAL_DOT:  # interpreter only: see _tile_dot_serial
            acc_gate += _tile_dot_serial(a, b_gate)
            acc_up += _tile_dot_serial(a, b_up)
        else:
            acc_gate = tl.dot(a, b_gate, acc_gate, input_precision=DOT_PRECISION)
            acc_up = tl.dot(a, b_up, acc_up, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        wg_ptrs += BLOCK_K * stride_wk
        wu_ptrs += BLOCK_K * stride_wk

    # round gate/up to the activation dtype as an unfused GEMM would store them, then SiLU-mul
    out_ty = act_ptr.dtype.element_ty
    gate = acc_gate.to(out_ty).to(tl.float32)
    up = acc_up.to(out_ty).to(tl.float32)
    act = gate / (1.0 + tl.exp(-gate)) * up
    act_ptrs = act_ptr + pair.to(tl.int64)[:, None] * stride_ap + offs_n[None, :]
    tl.store(act_ptrs, act.to(out_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _moe_down_kernel(
    # pointers
    act_ptr, w2_ptr, y_ptr, sorted_pair_ids_ptr, block_expert_ids_ptr,
    # sizes
    num_pairs, hidden, inter,
    # strides
    stride_ap, stride_we, stride_wn, stride_wk, stride_yp,
    # meta
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, UPCAST: tl.constexpr, SERIAL_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """y[pair, n] = act[pair] . w2[e, n]: each (token, rank) pair gets its own output row."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ids_ptr + pid_m)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pair_ids_ptr + offs_m)
    mask_m = pair < num_pairs
    pair = pair.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = act_ptr + pair[:, None] * stride_ap + offs_k[None, :]
    w_base = w2_ptr + expert.to(tl.int64) * stride_we
    b_ptrs = w_base + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        if EVEN_K:  # see the gate_up kernel
            a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=mask_n[None, :], other=0.0)
        else:
            mask_k = offs_k < inter - k0
            a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if SERIAL_DOT:
            acc += _tile_dot_serial(a, b)
        else:
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_wk

    y_ptrs = y_ptr + pair[:, None] * stride_yp + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _moe_combine_kernel(
    # pointers
    y_ptr, weights_ptr, ids_ptr, token_mask_ptr, out_ptr,
    # sizes
    hidden, num_experts,
    # strides
    stride_yp, stride_wt, stride_it, stride_ot,
    # meta
    TOP_K: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """out[t] = sum_{r=0..k-1} w[t, r] * y[t*k + r] in fp32, rank order fixed; masked -> 0.

    A pair that was dropped (masked token, or an unchecked out-of-range id) has no y row written
    and may carry garbage weights: its term is selected away, never multiplied by zero.
    """
    pid_t = tl.program_id(0).to(tl.int64)
    pid_h = tl.program_id(1)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < hidden
    # the token's keep flag as a vector (a scalar int1 mask trips the interpreter)
    keep_flag = tl.full([BLOCK_H], 1, dtype=tl.int32)
    if HAS_MASK:
        keep_flag = keep_flag * tl.load(token_mask_ptr + pid_t).to(tl.int32)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for r in tl.static_range(TOP_K):
        expert = tl.load(ids_ptr + pid_t * stride_it + r)
        in_range = ((expert >= 0) & (expert < num_experts)).to(tl.int32)
        valid = (keep_flag * in_range) != 0  # int product: stays a vector (see keep_flag)
        weight = tl.load(weights_ptr + pid_t * stride_wt + r).to(tl.float32)
        y = tl.load(y_ptr + (pid_t * TOP_K + r) * stride_yp + offs_h, mask=mask_h & valid,
                    other=0.0)
        acc += tl.where(valid, weight * y.to(tl.float32), 0.0)
    tl.store(out_ptr + pid_t * stride_ot + offs_h, acc.to(out_ptr.dtype.element_ty), mask=mask_h)
