"""MoE token sort before the grouped GEMMs, in one or two Triton launches (CUDA-graph capturable).

``moe_align(topk_ids [T, k], num_experts E, block_m, token_mask [T] | None)`` returns
``(sorted_pair_ids int32 [num_blocks * block_m], block_expert_ids int32 [num_blocks])``, bit for
bit ``moe_align_block_size_reference``'s layout (vLLM's moe_align_block_size): the T*k (token,
rank) pairs ``p = t * k + r``, stably sorted by expert id (token-major inside an expert), each
expert padded to a multiple of block_m rows with the value ``T * k``; masked tokens and ids
outside [0, E) are dropped; ``block_expert_ids`` is the expert of each block, -1 past the last
used one. ``num_blocks`` depends on (T, k, E, block_m) only, so no size depends on the routing.

Up to ``FUSED_MAX_PAIRS`` pairs (decode batches up to 512 at k = 8) the sort is one launch;
past it (prefill, larger batches), two. Both are over pieces of BLOCK_P pairs:
1. ``_moe_align_count_kernel`` (two-launch path only): each piece's histogram of expert ids
   (dropped pairs -> bin E).
2. ``_moe_align_scatter_kernel``: each piece gets the totals of every expert (-> padded expert
   starts) and the pairs of each expert in earlier pieces (-> its offset inside each expert):
   from the count kernel's [pieces, BINS] table, or, fused, by counting every pair itself,
   HIST_P at a time (each program reads all the ids: cheap at decode sizes, where one launch
   fewer is what counts). It ranks each of its pairs among its earlier pairs of the same expert
   (a [BLOCK_P, QB] compare, no sort) and writes it to ``start[e] + earlier[e] + rank``; it also
   writes its share of the padding slots and of ``block_expert_ids``.
Every value written is a pure function of the routing (integer counts), whatever the piece size,
the launch count or the order the programs run in, so the result is deterministic and equals
the reference.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.utils import (
    INDEX_DTYPES,
    cdiv,
    check_same_device,
    check_shape,
    check_tensor,
    next_power_of_2,
)


@triton.jit
def _pair_experts(
    topk_ids_ptr, token_mask_ptr, pairs, num_pairs, top_k, num_experts, stride_ids_t,
    HAS_MASK: tl.constexpr,
):
    """Expert id of each pair (int32), or ``num_experts`` for a dropped or out-of-range pair."""
    valid = pairs < num_pairs
    tokens = pairs // top_k
    ids = tl.load(topk_ids_ptr + tokens * stride_ids_t + pairs % top_k, mask=valid, other=-1)
    keep = valid & (ids >= 0) & (ids < num_experts)
    if HAS_MASK:
        keep = keep & (tl.load(token_mask_ptr + tokens, mask=valid, other=0) != 0)
    return tl.where(keep, ids, num_experts).to(tl.int32)


@triton.jit
def _moe_align_count_kernel(
    # pointers
    topk_ids_ptr,
    token_mask_ptr,
    counts_ptr,
    # sizes
    num_pairs,
    top_k,
    num_experts,
    # strides
    stride_ids_t,
    # meta
    HAS_MASK: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BINS: tl.constexpr,
):
    piece = tl.program_id(0)
    pairs = piece.to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    experts = _pair_experts(topk_ids_ptr, token_mask_ptr, pairs, num_pairs, top_k, num_experts,
                            stride_ids_t, HAS_MASK)
    # Past-the-end lanes also land in bin E, which nobody reads.
    tl.store(counts_ptr + piece * BINS + tl.arange(0, BINS), tl.histogram(experts, BINS))


@triton.jit
def _moe_align_scatter_kernel(
    # pointers
    topk_ids_ptr,
    token_mask_ptr,
    counts_ptr,
    base_ptr,
    sorted_ptr,
    block_expert_ptr,
    # sizes
    num_pairs,
    top_k,
    num_experts,
    num_pieces,
    num_blocks,
    block_m,
    # strides
    stride_ids_t,
    # meta
    HAS_MASK: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BINS: tl.constexpr,
    ROWS: tl.constexpr,
    FILL: tl.constexpr,
    QB: tl.constexpr,
    FUSED: tl.constexpr,
    HIST_P: tl.constexpr,
):
    piece = tl.program_id(0)
    offs_e = tl.arange(0, BINS)
    is_expert = offs_e < num_experts
    # Every piece's histogram: totals per expert, and the pairs of each expert in earlier pieces.
    total = tl.zeros([BINS], tl.int32)
    earlier = tl.zeros([BINS], tl.int32)
    if FUSED:  # count every pair here: no count launch, no table
        piece_start = piece.to(tl.int64) * BLOCK_P
        for c0 in range(0, num_pairs, HIST_P):
            chunk = c0 + tl.arange(0, HIST_P).to(tl.int64)
            chunk_experts = _pair_experts(topk_ids_ptr, token_mask_ptr, chunk, num_pairs, top_k,
                                          num_experts, stride_ids_t, HAS_MASK)
            total += tl.histogram(chunk_experts, BINS)
            earlier += tl.histogram(tl.where(chunk < piece_start, chunk_experts, num_experts),
                                    BINS)
    else:
        for r0 in range(0, num_pieces, ROWS):
            rows = r0 + tl.arange(0, ROWS)
            tile = tl.load(counts_ptr + rows[:, None] * BINS + offs_e[None, :],
                           mask=(rows < num_pieces)[:, None], other=0)
            total += tl.sum(tile, axis=0)
            earlier += tl.sum(tl.where((rows < piece)[:, None], tile, 0), axis=0)
    padded = tl.where(is_expert, (total + block_m - 1) // block_m * block_m, 0)
    padded_end = tl.cumsum(padded, axis=0)
    padded_start = padded_end - padded
    # The first row of expert e goes to padded_start[e] + earlier[e]; the base travels through
    # memory because each pair's expert id indexes it.
    tl.store(base_ptr + piece * BINS + offs_e, padded_start + earlier)
    tl.debug_barrier()

    # A pair's rank inside its expert within this piece: the pairs before it with the same id,
    # counted QB at a time (a [BLOCK_P, QB] compare; no sort needed, order is the pair index).
    pairs = piece.to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    experts = _pair_experts(topk_ids_ptr, token_mask_ptr, pairs, num_pairs, top_k, num_experts,
                            stride_ids_t, HAS_MASK)
    rank = tl.zeros([BLOCK_P], tl.int32)
    for q0 in range(0, BLOCK_P, QB):
        others = piece.to(tl.int64) * BLOCK_P + q0 + tl.arange(0, QB)
        other_experts = _pair_experts(topk_ids_ptr, token_mask_ptr, others, num_pairs, top_k,
                                      num_experts, stride_ids_t, HAS_MASK)
        before = (experts[:, None] == other_experts[None, :]) & (others[None, :] < pairs[:, None])
        rank += tl.sum(before.to(tl.int32), axis=1)
    kept = experts < num_experts
    base = tl.load(base_ptr + piece * BINS + experts, mask=kept, other=0)
    tl.store(sorted_ptr + base + rank, pairs.to(tl.int32), mask=kept)

    # This piece's share of the padding: experts e = piece (mod num_pieces) ...
    mine = is_expert & (offs_e % num_pieces == piece)
    fill_value = tl.zeros([BINS, FILL], tl.int32) + num_pairs
    for f0 in range(0, block_m, FILL):
        slots = (padded_start + total)[:, None] + f0 + tl.arange(0, FILL)[None, :]
        tl.store(sorted_ptr + slots, fill_value, mask=mine[:, None] & (slots < padded_end[:, None]))
    # ... and of the rows past the last used block, in strides of num_pieces * FILL.
    used = tl.max(padded_end, axis=0)
    max_rows = num_blocks * block_m
    tail = tl.zeros([FILL], tl.int32) + num_pairs
    for start in range(used + piece * FILL, max_rows, num_pieces * FILL):
        slots = start + tl.arange(0, FILL)
        tl.store(sorted_ptr + slots, tail, mask=slots < max_rows)
    # block_expert_ids[j] = number of experts whose padded range ends at or before row j*block_m
    # (searchsorted right), -1 when that is every expert; blocks j = piece (mod num_pieces).
    ends = tl.where(is_expert, padded_end, 2**30)
    for j0 in range(piece * ROWS, num_blocks, num_pieces * ROWS):
        blocks = j0 + tl.arange(0, ROWS)
        expert = tl.sum((ends[None, :] <= (blocks * block_m)[:, None]).to(tl.int32), axis=1)
        expert = tl.where(expert < num_experts, expert, -1)
        tl.store(block_expert_ptr + blocks, expert, mask=blocks < num_blocks)


@dataclass(frozen=True)
class MoEAlignConfig:
    """Pairs per piece, histogram bins (>= E + 1, a power of two), rows of the histogram table
    read per step, padding slots written per step, pairs compared per step of the rank; and
    whether the scatter launch counts the pairs itself (one launch), HIST_P pairs a step."""

    BLOCK_P: int
    BINS: int
    ROWS: int
    FILL: int
    QB: int
    num_warps: int
    fused: bool = False
    HIST_P: int = 1024


# Pairs up to which the sort is one launch: each of its programs then reads every id, at most
# FUSED_MAX_PAIRS / HIST_P = 4 steps. It covers decode batches up to 512 at k = 8 (the benchmarks
# run 128 and 256), where the sort is latency-bound; larger batches and prefills keep the count
# launch, which reads each id once.
FUSED_MAX_PAIRS = 4096


# Values a [.., ..] step of the scatter kernel may hold: 64 a thread over its 4 warps.
_STEP_VALUES = 64 * 32 * 4


@functools.lru_cache(maxsize=256)
def moe_align_config(num_pairs: int, num_experts: int, block_m: int) -> MoEAlignConfig:
    """Pure policy of (T*k, E, block_m); any value gives the same layout (integer counts).

    Every 2-D step of the scatter kernel (the [BLOCK_P, QB] rank compare, the [BINS, FILL]
    padding, the [ROWS, BINS] table reads) holds at most 64 values a thread, so nothing spills:
    pieces of 128 pairs compared 16 at a time over 4 warps. On the H200 (kernels-h200.json,
    ``moe_align_variant``) the former pick, 512 pairs compared 64 at a time over 8 warps, took
    264 us in the scatter launch at 1024 pairs; 128/16/4 took 8 us there and 13 us at 16384
    pairs. A [512, 64] padding step (256 experts at block_m 64) took 47 s to compile there and
    spills 1.1 KB (Triton 3.9's sm_90a build, ptxas -v; the policy's picks spill nothing). Past
    128 pieces (a 2048-token prefill at k = 8) pieces grow to 256 pairs, since every piece reads
    the whole [pieces, BINS] histogram table. Up to FUSED_MAX_PAIRS pairs the count launch is
    folded into the scatter launch (``fused``), 1024 pairs a counting step (8 a thread)."""
    bins = next_power_of_2(num_experts + 1)
    block_p = 256 if num_pairs > 128 * 128 else min(128, max(16, next_power_of_2(num_pairs)))
    fused = num_pairs <= FUSED_MAX_PAIRS
    return MoEAlignConfig(
        BLOCK_P=block_p,
        BINS=bins,
        ROWS=max(1, min(16, _STEP_VALUES // bins)),
        FILL=max(1, min(64, _STEP_VALUES // bins, max(16, next_power_of_2(block_m)))),
        QB=min(16, block_p),
        num_warps=4,
        fused=fused,
        HIST_P=min(1024, max(16, next_power_of_2(num_pairs))),
    )


def moe_num_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Blocks that bound every routing: T*k + min(E, T*k) * (block_m - 1) rows."""
    return cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m)


def moe_align(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_m: int,
    token_mask: torch.Tensor | None = None,
    *,
    config: MoEAlignConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pair_ids, block_expert_ids): ``moe_align_block_size_reference`` bit for bit (module
    docstring). ``config`` overrides the policy (tests: any piece size gives the same layout)."""
    check_tensor("topk_ids", topk_ids, ndim=2, dtypes=INDEX_DTYPES, last_dim_contiguous=True)
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts: expected an int >= 1, got {num_experts!r}")
    if not isinstance(block_m, int) or block_m < 1:
        raise ValueError(f"block_m: expected an int >= 1, got {block_m!r}")
    num_tokens, top_k = topk_ids.shape
    if token_mask is not None:
        check_tensor("token_mask", token_mask, ndim=1, dtypes=(torch.bool,), contiguous=True)
        check_shape("token_mask", token_mask, (num_tokens,))
        check_same_device(topk_ids=topk_ids, token_mask=token_mask)
    num_pairs = num_tokens * top_k
    num_blocks = moe_num_blocks(num_pairs, num_experts, block_m)
    device = topk_ids.device
    sorted_pair_ids = torch.empty(num_blocks * block_m, dtype=torch.int32, device=device)
    block_expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=device)
    if num_pairs == 0:
        return sorted_pair_ids, block_expert_ids
    cfg = config or moe_align_config(num_pairs, num_experts, block_m)
    if cfg.BINS < num_experts + 1:
        raise ValueError(f"config.BINS: expected >= num_experts + 1 ({num_experts + 1}), "
                         f"got {cfg.BINS}")
    if cfg.QB > cfg.BLOCK_P:
        raise ValueError(f"config.QB: expected <= BLOCK_P ({cfg.BLOCK_P}), got {cfg.QB}")
    if not isinstance(cfg.HIST_P, int) or cfg.HIST_P < 1 or cfg.HIST_P & (cfg.HIST_P - 1):
        raise ValueError(f"config.HIST_P: expected a power of two, got {cfg.HIST_P!r}")
    num_pieces = cdiv(num_pairs, cfg.BLOCK_P)
    base = torch.empty((num_pieces, cfg.BINS), dtype=torch.int32, device=device)
    mask_arg = token_mask.view(torch.uint8) if token_mask is not None else topk_ids  # unused dummy
    common = dict(HAS_MASK=token_mask is not None, BLOCK_P=cfg.BLOCK_P, BINS=cfg.BINS,
                  num_warps=cfg.num_warps)
    if cfg.fused:
        counts = base  # a placeholder argument: the FUSED kernel never loads counts_ptr
    else:
        counts = torch.empty((num_pieces, cfg.BINS), dtype=torch.int32, device=device)
        _moe_align_count_kernel[(num_pieces,)](
            topk_ids, mask_arg, counts, num_pairs, top_k, num_experts, topk_ids.stride(0),
            **common)
    _moe_align_scatter_kernel[(num_pieces,)](
        topk_ids, mask_arg, counts, base, sorted_pair_ids, block_expert_ids,
        num_pairs, top_k, num_experts, num_pieces, num_blocks, block_m, topk_ids.stride(0),
        ROWS=cfg.ROWS, FILL=cfg.FILL, QB=cfg.QB, FUSED=cfg.fused, HIST_P=cfg.HIST_P, **common)
    return sorted_pair_ids, block_expert_ids
