"""Paged attention: causal (chunked) ``prefill_attention`` and split-KV ``decode_attention``, with
their configs and per-mode policies. Kernels: ``attention_kernels.py``; the KV write that fills
the caches they read, ``store_kv``: ``kv_store.py``.

Layouts: K/V caches [num_blocks, block_size, num_kv_heads, head_dim] (block_size a power of 2
>= 8), per-sequence int32 block-table rows, GQA with num_q_heads a multiple of num_kv_heads,
head_dim a power of 2 in [16, 256]. Numerics: ``kernels.reference`` (softmax in fp32, output in
q's dtype).

Invariance, per op (the arithmetic both kernels share: ``attention_kernels.py``):

- ``prefill_attention`` (every mode): the config depends on (head_dim, dtype, split size) only,
  never on the chunk length or the batch, and a row's bits depend on its position, its keys
  and the split size alone: not on its query tile, its offset in it, the chunking of its
  prompt or the other sequences of the step. A chunk packed into a step at any row offset
  (beside zero-length padding rows and trailing padding tokens, whose rows are written as
  zeros) has the bits it has alone. The KV written by ``store_kv`` is a copy, identical by
  construction.
- ``decode_attention`` under ``corun`` and the batch-invariant modes: a sequence is cut into
  splits of a fixed ``split_size`` tokens, so its bits depend only on its own query, length and
  KV: not on the other sequences, the batch size, its slot, or ``max_seq_len`` (which only sizes
  the grid, so one launch shape serves every step of a CUDA graph). A sequence that is one split
  is written by stage 1 directly, whether or not the grid needs stage 2 for others. The splits
  are folded one at a time in split order, by stage 2 or, with ``fused_combine``, by the
  sequence's last lane inside stage 1: the same bits, so the choice may depend on anything.
  Under ``default`` the split size follows the batch's longest sequence and the batch size to
  fill the GPU, so a sequence's bits change when only the other sequences change.
- **decode == prefill** (path invariance): a token's decode row and its prefill row (the same
  query, position and keys) have the same bits when prefill runs with the decode's
  ``split_size`` (``prefill_attention(split_size=...)``; its BLOCK_N is then the decode's,
  ``decode_block_n``). The deterministic modes' engines pass it; ``default`` prefills each row
  as one split, and its decode splits follow the batch, so its two paths differ.

Host-side checks: shapes, dtypes, devices and host ints always. Checks that read tensor values
(cu_seqlens consistency, lengths vs table capacity, block ids < num_blocks, slots in range) run
only when the tensors are on the CPU: on a GPU they would cost a device sync per call and break
CUDA-graph capture.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kernels.attention_kernels import (
    LOG2E,
    _decode_combine_kernel,
    _decode_split_kernel,
    _prefill_attention_kernel,
)
from kernels.kv_store import check_caches, is_pow2
from kernels.mode import Mode
from kernels.utils import (
    FLOAT_DTYPES,
    cdiv,
    check_block_ids,
    check_same_device,
    check_shape,
    check_softmax_scale,
    check_tensor,
    dot_precision,
    is_host_checkable,
    is_interpreter,
    next_power_of_2,
    preload_page_count,
    upcast_dot_operands,
)

# H200 streaming multiprocessors; the default decode policy sizes its grid to fill them.
NUM_SMS = 132
# Decode aims at this many stage-1 programs (two waves hide the tail of the first).
DECODE_TARGET_PROGRAMS = 2 * NUM_SMS
# Stage-1 programs an H200 holds at once: 3 per SM, set by the split kernel's 157 registers x 128
# threads (experiments/results/ptxas-decode-attention-sm90.json). experiments/bench_attention.py's
# ``corun_lanes3`` rows time as many lanes as fit it instead of about DECODE_TARGET_PROGRAMS.
DECODE_RESIDENT_PROGRAMS = 3 * NUM_SMS
# Stage-1 programs up to which a preloading split launch runs 3 stages: its two K and two V
# buffers (76 KB of shared memory, experiments/results/ptxas-decode-attention-sm90.json) fit two
# programs an SM, so a larger grid would take a second wave (``_with_preload``).
DECODE_PRELOAD_3_STAGE_PROGRAMS = 2 * NUM_SMS
# Cap on the default mode's splits, bounding the partial-output buffer and the combine loop.
DECODE_MAX_SPLITS_DEFAULT = 64
# A prefill without a split size runs each row as one split of at most this many keys (more
# than any context a block table can hold).
ONE_SPLIT = 2**30


def _dot_precision(dtype: torch.dtype) -> str:
    # Upcast bf16 tiles (interpreter only) are fp32 operands and take the fp32 setting too.
    return "ieee" if upcast_dot_operands(dtype) else dot_precision(dtype)


# ----------------------------------------------------------------------------------------------
# shared validation
# ----------------------------------------------------------------------------------------------


def _check_paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor
) -> None:
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    check_caches(k_cache, v_cache, q.dtype)
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"k_cache: head_dim {k_cache.shape[3]} != q head_dim {head_dim}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"q: num_q_heads {num_q_heads} is not a multiple of num_kv_heads "
                         f"{num_kv_heads}")
    if not is_pow2(head_dim) or not 16 <= head_dim <= 256:
        raise ValueError(f"q: head_dim must be a power of 2 in [16, 256], got {head_dim}")
    check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32,))
    if block_tables.stride(1) != 1:
        raise ValueError(f"block_tables: expected contiguous rows, got strides "
                         f"{block_tables.stride()}")


# ----------------------------------------------------------------------------------------------
# prefill
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PrefillAttentionConfig:
    BLOCK_M: int
    BLOCK_N: int
    num_warps: int
    num_stages: int


def prefill_attention_config(
    head_dim: int, dtype: torch.dtype, mode: Mode, split_size: int | None = None
) -> PrefillAttentionConfig:
    """Tile config of prefill attention. Depends on (head_dim, dtype, split_size) only: never on
    the chunk length or the batch, so chunked and whole prefill walk the same KV tiles. The same
    in every mode (the kernel is already chunk- and batch-invariant). With a split size the KV
    tile is the decode kernel's (``decode_block_n``): a row's online softmax then takes the
    decode's steps."""
    if dtype == torch.float32:  # 4-byte tiles: halve them to stay within shared memory
        cfg = PrefillAttentionConfig(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)
    elif head_dim >= 128:
        cfg = PrefillAttentionConfig(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
    else:
        cfg = PrefillAttentionConfig(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3)
    if split_size is None:
        return cfg
    return dataclasses.replace(cfg, BLOCK_N=decode_block_n(split_size))


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    max_q_len: int,
    mode: Mode = Mode.CORUN,
    split_size: int | None = None,
    config: PrefillAttentionConfig | None = None,
) -> torch.Tensor:
    """Causal, variable-length, chunked prefill over the paged cache -> [T, Hq, D] in q's dtype.

    q [T, Hq, D] holds each sequence's chunk back to back (``cu_seqlens_q`` [B + 1] int32);
    ``context_lens`` [B] int32 is each sequence's length including the chunk, whose K/V must
    already be stored; query i of sequence b sits at position context_lens[b] - q_len_b + i.
    Chunk- and batch-invariant in every mode (module docstring). ``split_size``: each row's keys
    are cut into splits of that many tokens and folded as ``decode_attention`` folds a
    sequence's, so a row has the bits of the decode of the same token at that split size (a
    multiple of the config's BLOCK_N); None: one split, whatever the length. ``config``
    overrides the policy (tests use small tiles to exercise many tiles cheaply).

    Packed steps (several requests' chunks in one fixed-shape step): a row of length 0
    (q_len 0, context_len 0) is a padding slot and contributes nothing; rows of q after
    cu_seqlens_q[-1] belong to no sequence and their output rows are written as zeros. Neither
    needs a host sync, so the launch stays capturable in a CUDA graph.
    """
    _check_paged_attention(q, k_cache, v_cache, block_tables)
    scale = check_softmax_scale(scale)
    check_tensor("cu_seqlens_q", cu_seqlens_q, ndim=1, dtypes=(torch.int32,), contiguous=True)
    num_seqs = cu_seqlens_q.shape[0] - 1
    if num_seqs < 1:
        raise ValueError("cu_seqlens_q: expected at least 2 entries (B + 1)")
    check_tensor("context_lens", context_lens, ndim=1, dtypes=(torch.int32,), contiguous=True)
    check_shape("context_lens", context_lens, (num_seqs,))
    check_shape("block_tables", block_tables, (num_seqs, -1))
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                      cu_seqlens_q=cu_seqlens_q, context_lens=context_lens)
    block_size, capacity = k_cache.shape[1], block_tables.shape[1] * k_cache.shape[1]
    if not isinstance(max_q_len, int) or max_q_len < 0:
        raise ValueError(f"max_q_len: expected a host int >= 0, got {max_q_len!r}")
    if is_host_checkable(cu_seqlens_q):
        cu = cu_seqlens_q.tolist()
        q_lens = [cu[i + 1] - cu[i] for i in range(num_seqs)]
        if cu[0] != 0 or cu[-1] > q.shape[0] or min(q_lens) < 0:
            raise ValueError(f"cu_seqlens_q: expected non-decreasing offsets from 0 to at most "
                             f"T={q.shape[0]}, got {cu}")
        if max(q_lens) > max_q_len:
            raise ValueError(f"max_q_len: {max_q_len} < the longest chunk {max(q_lens)}")
        ctx = context_lens.tolist()
        if any(c < n for c, n in zip(ctx, q_lens, strict=True)) or max(ctx) > capacity:
            raise ValueError(f"context_lens: each must lie in [q_len, {capacity}] "
                             f"(q_lens {q_lens}, table capacity {capacity}), got {ctx}")
        check_block_ids(block_tables, context_lens, block_size, k_cache.shape[0])

    cfg = config or prefill_attention_config(q.shape[2], q.dtype, mode, split_size)
    if split_size is not None and (isinstance(split_size, bool) or not isinstance(split_size, int)
                                   or split_size < 1 or split_size % cfg.BLOCK_N):
        raise ValueError(f"split_size: expected None or a positive multiple of BLOCK_N "
                         f"{cfg.BLOCK_N}, got {split_size!r}")
    out = torch.empty_like(q)
    if q.shape[0] == 0:
        return out
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    # At least one tile lane: with max_q_len 0 (a step of padding only) the padding rows still
    # need their zeros. A chunk fits its table, so a bound past the capacity (a step shape's
    # chunk size above max_model_len) sizes no more lanes than the capacity needs.
    num_m_tiles = max(1, cdiv(min(max_q_len, capacity), cfg.BLOCK_M))
    # Sequence index num_seqs is the padding program: it zeroes rows cu_seqlens_q[-1] .. T - 1.
    grid = (num_q_heads, num_m_tiles, num_seqs + 1)
    _prefill_attention_kernel[grid](
        q, k_cache, v_cache, out, block_tables, cu_seqlens_q, context_lens,
        q.shape[0], num_seqs, num_m_tiles, num_q_heads // k_cache.shape[2], block_size,
        ONE_SPLIT if split_size is None else split_size, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_D=head_dim,
        UPCAST=upcast_dot_operands(q.dtype), SERIAL_DOT=is_interpreter(),
        DOT_PRECISION=_dot_precision(q.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


# ----------------------------------------------------------------------------------------------
# decode
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeAttentionConfig:
    split_size: int  # tokens per split; splits of a sequence start at multiples of it
    max_num_splits: int  # cdiv(max_seq_len, split_size): the partial buffers' split dim
    num_split_programs: int  # stage-1 lanes per (sequence, kv head), each a contiguous run
    BLOCK_N: int
    BLOCK_H: int  # query heads of one kv head, padded to >= 16 rows for tl.dot
    num_warps: int
    num_stages: int
    # The last lane of each (sequence, kv head) combines the splits in the split launch: one
    # launch instead of two, the same bits (``_decode_split_kernel``). Off in every policy until
    # timed on the H200 (experiments/bench_attention.py's ``corun_fused`` rows).
    fused_combine: bool = False
    # Each lane loads its block ids before its token loop (``_decode_split_kernel``'s
    # LANE_PAGES; ``decode_preloaded_pages`` sizes it per launch): the same bits. The fixed-split
    # policies turn it on wherever the ids fit (``_with_preload``); default never does.
    preload_pages: bool = False


def decode_preloaded_pages(cfg: DecodeAttentionConfig, block_size: int) -> int:
    """The split kernel's LANE_PAGES: block ids a lane loads before its token loop, covering the
    longest run of splits a lane can take (lane l of L takes splits l*n//L .. (l+1)*n//L - 1 of a
    sequence's n <= max_num_splits: at most cdiv(max_num_splits, L)), or 0 (ids loaded tile by
    tile) when the config does not preload or the run spans more than
    ``kernels.utils.MAX_PRELOAD_PAGES`` pages. A pure function of the config and the page size."""
    if not cfg.preload_pages:
        return 0
    splits_per_lane = cdiv(cfg.max_num_splits, cfg.num_split_programs)
    # A lane's run starts at a multiple of split_size: on a page boundary when pages divide it.
    return preload_page_count(splits_per_lane * cfg.split_size, block_size,
                              cfg.split_size % block_size == 0)


def decode_launch_grids(cfg: DecodeAttentionConfig, num_seqs: int, num_q_heads: int,
                        num_kv_heads: int) -> list[tuple[int, ...]]:
    """The grids ``decode_attention`` launches with ``cfg``, in order: the split kernel's
    (sequence, kv head, lane), then the combine's (sequence, q head) unless every sequence is one
    split or the combine is fused into the split launch."""
    grids = [(num_seqs, num_kv_heads, cfg.num_split_programs)]
    if cfg.max_num_splits > 1 and not cfg.fused_combine:
        grids.append((num_seqs, num_q_heads))
    return grids


def decode_block_n(split_size: int) -> int:
    """The KV tile of the fixed-split decode (and of a prefill that follows its splits): the
    largest of 64, 32, 16 that divides the split size."""
    return next(bn for bn in (64, 32, 16) if split_size % bn == 0)


def decode_lanes(max_num_splits: int, programs_per_split: int, target_programs: int) -> int:
    """Stage-1 lanes per (sequence, kv head) for the fixed-split policies: about
    ``target_programs`` programs in all, never more lanes than splits. A lane walks a contiguous
    run of its sequence's splits, so the lanes only size the grid; a split's arithmetic (and so
    every bit) is the same whatever this returns."""
    return max(1, min(max_num_splits, cdiv(target_programs, max(1, programs_per_split))))


def decode_attention_config(
    batch: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_seq_len: int,
    dtype: torch.dtype,
    mode: Mode,
    split_size: int = 256,
    block_size: int = 16,
) -> DecodeAttentionConfig:
    """Split-KV policy of decode attention (``block_size``: the cache's tokens a page).

    - corun / batch_invariant: the split size is ``split_size`` (a multiple of 16), whatever the
      batch, so a sequence's split count is cdiv(its length, split_size). ``max_seq_len`` and the
      batch only size the grid (lanes), which never changes a split's arithmetic. A lane loads
      its block ids before its token loop wherever they fit (``decode_preloaded_pages``), at 3
      stages where the grid fits ``DECODE_PRELOAD_3_STAGE_PROGRAMS``: speed only, the same bits.
    - default: the split count fills the GPU from (batch, num_kv_heads, max_seq_len): about
      DECODE_TARGET_PROGRAMS stage-1 programs, split size cdiv(max_seq_len, num_splits) rounded up
      to BLOCK_N. A sequence's splits then follow the batch's longest sequence: not invariant.
    """
    if max_seq_len < 1:
        raise ValueError(f"max_seq_len: expected >= 1, got {max_seq_len}")
    group = num_q_heads // num_kv_heads
    block_h = max(16, next_power_of_2(group))
    programs_per_split = max(1, batch * num_kv_heads)
    if mode == Mode.DEFAULT:
        block_n = 64
        num_splits = cdiv(DECODE_TARGET_PROGRAMS, programs_per_split)
        num_splits = max(1, min(num_splits, DECODE_MAX_SPLITS_DEFAULT, cdiv(max_seq_len, block_n)))
        size = cdiv(cdiv(max_seq_len, num_splits), block_n) * block_n
        max_num_splits = cdiv(max_seq_len, size)
        lanes = max_num_splits  # one split per program
    else:
        if split_size < 16 or split_size % 16:
            raise ValueError(f"split_size: expected a positive multiple of 16, got {split_size}")
        size, block_n = split_size, decode_block_n(split_size)
        max_num_splits = cdiv(max_seq_len, size)
        # Enough lanes to fill the GPU; programs loop over the remaining splits.
        lanes = decode_lanes(max_num_splits, programs_per_split, DECODE_TARGET_PROGRAMS)
    num_warps = 4 if head_dim <= 128 else 8
    cfg = DecodeAttentionConfig(
        split_size=size, max_num_splits=max_num_splits, num_split_programs=max(1, lanes),
        BLOCK_N=block_n, BLOCK_H=block_h, num_warps=num_warps, num_stages=2,
    )
    if mode == Mode.DEFAULT:
        return cfg
    return _with_preload(cfg, programs_per_split, block_size)


def _with_preload(cfg: DecodeAttentionConfig, programs_per_split: int,
                  block_size: int) -> DecodeAttentionConfig:
    """The fixed-split policies' preload, from an H100's rows (kernels-h100-attention-run8.json,
    2026-12-06: ``corun`` and its ``corun_preload_s2`` / ``_s3`` variants against
    ``corun_table_ids``, the loop that loads the ids tile by tile): at 2 stages the preload took
    less time at all 12 points where a lane's ids fit, B 1 to 128 (1.01-1.09x as fast); 3 stages
    more where the grid fit two programs an SM (B 1 at every context, B 8 at 512 tokens:
    1.05-1.17x) but less past it (B 8 from 2048 tokens: 5 lanes, 320 programs, 0.91-0.97x).
    More tiles in flight do not help a small batch: at 4 and 5 stages (kernels-h100.json's
    run10, B <= 8) the preload took 1.01-1.14x and 1.07-1.42x as long as the policy."""
    preloaded = dataclasses.replace(cfg, preload_pages=True)
    if not decode_preloaded_pages(preloaded, block_size):
        return cfg
    if programs_per_split * cfg.num_split_programs <= DECODE_PRELOAD_3_STAGE_PROGRAMS:
        return dataclasses.replace(preloaded, num_stages=3)
    return preloaded


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_seq_len: int,
    mode: Mode = Mode.CORUN,
    split_size: int = 256,
    config: DecodeAttentionConfig | None = None,
    fused_combine: bool = False,
    arrivals: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per sequence over its ``seq_lens[b]`` cached tokens -> [B, Hq, D] in q's dtype.

    Split-KV flash decoding: stage 1 reads each KV tile once for all query heads of its kv head
    and writes per-split fp32 partial outputs and log-sum-exps; stage 2 combines a sequence's
    splits in split order. A sequence of one split is written by stage 1 directly (no partials),
    and when every sequence fits one split (max_seq_len <= the split size) stage 2 is not
    launched at all: both are functions of the sequence's own length, so its bits are the same
    whichever launch count the grid bound gives. ``max_seq_len`` (host int) bounds every seq_len:
    max_model_len under corun / batch_invariant (fixed launch shape), the batch's longest under
    default. seq_len 0 (a dummy slot) gives zeros. Invariance per mode: module docstring.

    ``fused_combine`` turns the policy's fused combine on (``config`` carries its own); the bits
    are those of the two launches. ``arrivals`` (int32, >= B * num_kv_heads zeros) is its
    per-(sequence, kv head) arrival count; the kernel leaves it zeroed, so a caller can hold one
    buffer for every call (under a CUDA graph: no memset). Without it a fused launch allocates
    zeros each call.
    """
    _check_paged_attention(q, k_cache, v_cache, block_tables)
    scale = check_softmax_scale(scale)
    num_seqs, num_q_heads, head_dim = q.shape
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,), contiguous=True)
    check_shape("seq_lens", seq_lens, (num_seqs,))
    check_shape("block_tables", block_tables, (num_seqs, -1))
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                      seq_lens=seq_lens)
    block_size, capacity = k_cache.shape[1], block_tables.shape[1] * k_cache.shape[1]
    if not isinstance(max_seq_len, int) or max_seq_len < 1:
        raise ValueError(f"max_seq_len: expected a host int >= 1, got {max_seq_len!r}")
    # max_seq_len may exceed the table width (under corun it is max_model_len, whatever width the
    # engine gives the tables): the kernels never read table entries past a sequence's length.
    if is_host_checkable(seq_lens) and num_seqs:
        lens = seq_lens.tolist()
        if min(lens) < 0 or max(lens) > min(max_seq_len, capacity):
            raise ValueError(f"seq_lens: each must lie in [0, min(max_seq_len={max_seq_len}, "
                             f"table capacity {capacity})], got {lens}")
        check_block_ids(block_tables, seq_lens, block_size, k_cache.shape[0])

    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    num_kv_heads = k_cache.shape[2]
    cfg = config or decode_attention_config(num_seqs, num_q_heads, num_kv_heads, head_dim,
                                            max_seq_len, q.dtype, mode, split_size, block_size)
    if fused_combine and config is None:
        cfg = dataclasses.replace(cfg, fused_combine=True)
    if cfg.max_num_splits > 1:
        mid_o = torch.empty((num_seqs, num_q_heads, cfg.max_num_splits, head_dim),
                            dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((num_seqs, num_q_heads, cfg.max_num_splits),
                              dtype=torch.float32, device=q.device)
    else:  # every sequence is one split, written by stage 1: one launch, no partials
        mid_o = mid_lse = out.new_empty((1, 1, 1), dtype=torch.float32)
    fused = cfg.fused_combine and cfg.max_num_splits > 1
    if fused and arrivals is None:
        arrivals = torch.zeros(num_seqs * num_kv_heads, dtype=torch.int32, device=q.device)
    elif fused:
        check_tensor("arrivals", arrivals, ndim=1, dtypes=(torch.int32,), contiguous=True)
        if arrivals.numel() < num_seqs * num_kv_heads:
            raise ValueError(f"arrivals: expected >= {num_seqs * num_kv_heads} counts "
                             f"(B x kv heads), got {arrivals.numel()}")
        check_same_device(q=q, arrivals=arrivals)
    split_grid, *combine_grid = decode_launch_grids(cfg, num_seqs, num_q_heads, num_kv_heads)
    _decode_split_kernel[split_grid](
        q, k_cache, v_cache, block_tables, seq_lens, out, mid_o, mid_lse,
        arrivals if fused else mid_lse,
        num_q_heads // num_kv_heads, block_size, cfg.split_size, cfg.num_split_programs,
        scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        BLOCK_N=cfg.BLOCK_N, BLOCK_H=cfg.BLOCK_H, BLOCK_D=head_dim,
        UPCAST=upcast_dot_operands(q.dtype), SERIAL_DOT=is_interpreter(),
        DOT_PRECISION=_dot_precision(q.dtype), FUSED_COMBINE=fused, GPU_FENCE=q.is_cuda,
        LANE_PAGES=decode_preloaded_pages(cfg, block_size),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if combine_grid:
        _decode_combine_kernel[combine_grid[0]](
            mid_o, mid_lse, seq_lens, out,
            head_dim, cfg.split_size,
            mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0),
            mid_lse.stride(1), out.stride(0), out.stride(1),
            BLOCK_D=head_dim, num_warps=4,
        )
    return out
