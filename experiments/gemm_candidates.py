"""The GEMM tuner's candidate space: which configs ``experiments.tune_gemm`` times at a point.

``candidates(m, n, k)`` is a bounded set per M range (decode, mid M 65-256, large M), each tile
also split-K where the tiles alone leave SMs idle, stream-K at the decode batches and mid M,
TMA-fed from ``TMA_MIN_M``, deeper whole tiles at mid M and tail tiles where N is a whole number
of them and not of 256, or at mid M of them at all, with split twins there (``tail_tiles``).
``candidate_set(m, n)`` names the generator a table entry was tuned with, so
``tune_gemm --retune-m`` redoes only the points whose candidates changed.
``BATCH_INVARIANT_POOL`` is the portable batch-invariant peer's pool (one config for every M).
Each constant says which measurement put it there.
"""

from __future__ import annotations

import dataclasses

import torch

from kernels.gemm import (
    H200_NUM_SMS,
    MIN_K_BLOCKS_PER_SPLIT,
    TARGET_NUM_CTAS,
    GemmConfig,
    auto_split_k,
    fit_smem,
)
from kernels.utils import cdiv

DTYPE = torch.bfloat16  # what tune_gemm times the candidates in

# One config for every M; persistent (one program per SM looping over tiles).
BATCH_INVARIANT_POOL = (
    GemmConfig(128, 128, 64, num_warps=8, num_stages=4, persistent=True),
    GemmConfig(128, 256, 64, num_warps=8, num_stages=3, persistent=True),
    GemmConfig(64, 128, 64, num_warps=4, num_stages=4, persistent=True),
    GemmConfig(64, 64, 64, num_warps=4, num_stages=4, persistent=True),
)
# (block_n, block_k, num_warps, num_stages) tiles per M range; block_m follows M for decode. The
# 64-deep ones are for short K: DeepSeek-V3's kv_b (K = 512) had only the three deep tiles, two
# K steps each, and ran at 0.47 of cuBLAS at M 1 on the H200; 64-deep steps keep a pipeline going
# and leave shared memory for more programs an SM.
_DECODE_TILES = ((32, 256, 4, 4), (64, 128, 4, 4), (64, 256, 4, 3), (64, 64, 4, 4),
                 (128, 64, 4, 4))
# Mid M (65..256) streams the weights like decode but fills few tiles: one M tile of 128 reads each
# weight tile once, and split-K 2 / 3 / 4 (corun and default only) is what fills the 132 SMs. 3
# because the H200 picked split 2 for Qwen3-8B's qkv at M 128 (96 tiles of 128 x 64 -> 192
# programs on 132 SMs, 0.66 of cuBLAS): an uneven split shifts where the last wave ends.
# 128 x 256: every program re-reads x's whole [M, K] rows from L2, so at M = 128 the 64-wide tiles
# the H200 picked for the wide unsplit GEMMs (N 5120-36864, 0.73-0.80 of cuBLAS) read x twice
# over for each byte of weights they stream; 256-wide tiles read it half over.
_MID_TILES = ((64, 128, 64, 4, 4), (128, 128, 64, 8, 4), (128, 64, 64, 4, 4), (64, 64, 128, 4, 4),
              (128, 32, 128, 4, 4), (128, 64, 128, 8, 3), (128, 256, 64, 8, 3))
_MID_SPLITS = (2, 3, 4)
# M from which candidates also run with TMA-fed tiles (GemmConfig.tma): the serving (64) and
# offline (128) decode batches and mid M, where the weights stream from HBM, and since
# 2026-12-06 large M too, where an H100 run of DeepSeek-V3's shapes had no TMA candidate to pick.
TMA_MIN_M = 64
# Stream-K (GemmConfig.stream_k_programs) at the decode batches and mid M, for the tiles of one
# row tile (block_m >= M): one or two programs an SM share the column-tile x K-block iterations
# equally, where whole tiles leave a partial wave (Qwen3-8B's qkv at M 128: 96 tiles of 128 x 64,
# split 2 -> 192 programs on 132 SMs, 0.72 of cuBLAS in the tuner). M 256 gets 256-row tiles.
STREAM_K_M_RANGE = (64, 256)
STREAM_K_PROGRAMS = (H200_NUM_SMS, 2 * H200_NUM_SMS)
_STREAM_K_TILES_256 = ((256, 64, 64, 8, 3), (256, 128, 64, 8, 3))
# Names the candidate generator an entry was tuned with, per M range (``candidate_set``);
# --retune-m re-tunes entries of another. The large-M name changed alone when large M gained
# splits 4 and 8, so re-tuning M 512-8192 leaves the other M's entries current.
CANDIDATE_SET = "tma-split3-bk64-decode-bn256-streamk"
MID_M_CANDIDATE_SET = CANDIDATE_SET + "-deep"
LARGE_M_CANDIDATE_SET = CANDIDATE_SET + "-largesplit8-tma-narrow"
# Deeper pipelines at mid M, TMA-fed whole tiles only: an H100 probe
# (probe-gemm-mid-m-h100-run2.json) ran Qwen3-8B's qkv at M 128 at 0.94 of cuBLAS with
# 128 x 64 x 64 at 7 stages and 4 warps (the set's best: 0.79 at 3), its M 256 and DeepSeek-V3's
# q_b at M 256 at 0.91 / 0.87 with 128 x 128 x 64 at 6 (0.80 / 0.79): at M <= 256 a program
# streams its weight tiles, and more stages keep more of them in flight. Splits and stream-K
# lost at every one of those points.
_MID_DEEP_TILES = ((128, 64, 64, 4, 5), (128, 64, 64, 4, 6), (128, 64, 64, 4, 7),
                   (128, 64, 64, 8, 7), (128, 64, 128, 4, 4), (128, 64, 128, 8, 4),
                   (128, 128, 64, 4, 3), (128, 128, 64, 4, 5), (128, 128, 64, 4, 6),
                   (128, 128, 64, 8, 5), (128, 128, 64, 8, 6))
# The 64- and 128-wide tiles are for narrow N and partial waves: an H100 run of DeepSeek-V3's
# large-M shapes (experiments/results/tune-gemm-deepseek-large-m-h100-before.json) had the four
# wide tiles, and kv_a (N 576 = 2.25 x 256) at M 8192 ran at 0.66 of cuBLAS, q_a at M 2048 (96
# tiles of 128 x 256 on 132 SMs) at 0.75.
_LARGE_TILES = ((128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3),
                (64, 256, 64, 4, 4), (128, 256, 64, 8, 4), (128, 128, 64, 4, 4),
                (128, 64, 64, 4, 4), (64, 128, 64, 4, 4))
# Column tiles of block_n + block_n_tail (GemmConfig.block_n_tail, two products from one x tile)
# where N is a whole number of them and not of 256 columns: DeepSeek-V3's kv_a (N 576 = 3 x 192)
# ran at 0.64 of cuBLAS at M 8192 on an H100 with its 64 x 256 pick (768 columns for 576), and a
# column split into two launches reached 0.70 (probe-gemm-narrow-n-h100.json). Each is the twin
# of every candidate with that block_n (its splits and TMA feed too, stream-K aside).
_TAIL_TILES = ((128, 64), (64, 32))  # (block_n, block_n_tail)
# Large M also gets 64-row tail tiles at 3 stages, two programs an SM (98 KB of shared memory):
# kv_a's 192 tiles of 128 x 192 at M 8192 run in two waves on 132 SMs, the second 45% full.
_LARGE_TAIL_TILES = ((64, 128, 64, 4, 3),)  # (block_m, block_n, block_k, warps, stages)
TAIL_CANDIDATE_SUFFIX = "-tail"
# At mid M (65..256) tail tiles also change how many programs fill the SMs where 256 divides N:
# DeepSeek-V3's q_a (N 1536, K 7168) at M 128 has 24 tiles of 128 x 64 (96 programs at the H100
# pick's split 4, 0.83 of cuBLAS) and 16 of 128 x (64 + 32), 128 programs at split 8 (0.91);
# at M 256, 128 x (64 + 32) at split 4 ran at 0.89 against the pick's 0.79
# (probe-gemm-tail-h100-run16.json). So at mid M every TMA-fed whole-tile twin is also split 2,
# 4 and 8 where the programs stay within two an SM; Qwen3-8B's qkv lost with tails there (0.80
# at best against the pick's 0.90-0.94), which the tuner's timing, not this list, decides.
_MID_TAIL_SPLITS = (2, 4, 8)
MID_TAIL_CANDIDATE_SUFFIX = "-tail-waves"


def _mid_m(m: int) -> bool:
    return 64 < m <= 256


def wave_splits(config: GemmConfig, m: int, n: int, k: int,
                splits: tuple[int, ...] = _MID_TAIL_SPLITS) -> list[GemmConfig]:
    """``config`` split each of ``splits`` ways where its programs stay within
    ``TARGET_NUM_CTAS`` (two an SM) and each split keeps ``MIN_K_BLOCKS_PER_SPLIT`` K blocks."""
    programs = cdiv(m, config.block_m) * cdiv(n, config.tile_n)
    return [dataclasses.replace(config, split_k=split) for split in splits
            if programs * split <= TARGET_NUM_CTAS
            and cdiv(k, config.block_k) >= MIN_K_BLOCKS_PER_SPLIT * split]


def tail_tiles(n: int, m: int | None = None) -> tuple[tuple[int, int], ...]:
    """The (block_n, block_n_tail) of ``_TAIL_TILES`` whose width divides N, where 256 does not,
    and at a mid M (65..256) where it does too."""
    if n % 256 == 0 and not (m is not None and _mid_m(m)):
        return ()
    return tuple((bn, tail) for bn, tail in _TAIL_TILES if n % (bn + tail) == 0)


# Large M (prefill) with few tiles splits K 2, 4 or 8 ways, as many as keep the programs within
# two an SM: DeepSeek-V3's narrow kv_a (N 576, K 7168) has 24 tiles of 64 x 256 at M 512, 48
# programs at split 2, and ran at 0.54 of cuBLAS on the H200 (kernels-h200.json, 2026-12-05).
_LARGE_SPLITS = (2, 4, 8)


def candidate_set(m: int, n: int | None = None) -> str:
    """The name of the candidate generator at M (what an entry records), with
    ``TAIL_CANDIDATE_SUFFIX`` where N takes tail tiles (``tail_tiles``; at mid M
    ``MID_TAIL_CANDIDATE_SUFFIX``, their split twins with them), so adding them made only those
    points stale."""
    if m > 256:
        name = LARGE_M_CANDIDATE_SET
    else:
        name = MID_M_CANDIDATE_SET if m > 64 else CANDIDATE_SET
    if n is None or not tail_tiles(n, m):
        return name
    return name + (MID_TAIL_CANDIDATE_SUFFIX if _mid_m(m) else TAIL_CANDIDATE_SUFFIX)


def candidates(m: int, n: int, k: int, with_pool: bool = True) -> list[GemmConfig]:
    """The bounded candidate set at one point: M-range tiles, each without and with auto split-K
    (mid M also with split-K 2, 3 and 4, large M with 2, 4 and 8 where the tiles leave SMs idle,
    as many as keep the programs within two an SM); for M in ``STREAM_K_M_RANGE`` also each tile
    of one row tile as stream-K over ``STREAM_K_PROGRAMS``; from ``TMA_MIN_M`` on every one of
    those TMA-fed as well; at mid M (65..256) the deeper TMA-fed whole tiles of
    ``_MID_DEEP_TILES``; where N takes tail tiles (``tail_tiles``), the twin with the tail of
    every candidate of that block_n but stream-K (at mid M fitted to shared memory, and each
    TMA-fed unsplit twin also split ``_MID_TAIL_SPLITS`` ways within two programs an SM); plus
    the batch-invariant pool when
    ``with_pool`` (timed at every point of the bench shapes for its geometric mean)."""
    tiles: list[GemmConfig] = []
    splits: tuple[int, ...] = ()
    if m <= 64:
        block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
        tiles = [GemmConfig(block_m, bn, bk, num_warps=w, num_stages=s)
                 for bn, bk, w, s in _DECODE_TILES]
    elif m <= 256:
        tiles = [GemmConfig(bm, bn, bk, num_warps=w, num_stages=s)
                 for bm, bn, bk, w, s in _MID_TILES]
        splits = _MID_SPLITS
    else:
        tiles = [GemmConfig(bm, bn, bk, num_warps=w, num_stages=s)
                 for bm, bn, bk, w, s in _LARGE_TILES]
    if STREAM_K_M_RANGE[0] <= m <= STREAM_K_M_RANGE[1] and m > 128:
        stream_tiles = [GemmConfig(bm, bn, bk, num_warps=w, num_stages=s)
                        for bm, bn, bk, w, s in _STREAM_K_TILES_256]
    else:
        stream_tiles = []
    out: list[GemmConfig] = []
    for tile in tiles:
        out.append(tile)
        k_blocks = -(-k // tile.block_k)
        num_tiles = -(-m // tile.block_m) * -(-n // tile.block_n)
        tile_splits = {auto_split_k(m, n, k, tile.block_m, tile.block_n, tile.block_k)}
        tile_splits |= set(splits)
        if m > 256 and num_tiles < H200_NUM_SMS:
            tile_splits |= {split for split in _LARGE_SPLITS
                            if split == 2 or num_tiles * split <= 2 * H200_NUM_SMS}
        for split in sorted(tile_splits):
            if split > 1 and k_blocks >= 2 * split:  # >= 2 K blocks per split
                out.append(dataclasses.replace(tile, split_k=split))
    if STREAM_K_M_RANGE[0] <= m <= STREAM_K_M_RANGE[1]:
        out += [dataclasses.replace(tile, stream_k_programs=programs)
                for tile in [*tiles, *stream_tiles] if tile.block_m >= m
                for programs in STREAM_K_PROGRAMS]
    if m >= TMA_MIN_M:
        out += [dataclasses.replace(c, tma=True) for c in out]
    if candidate_set(m) == MID_M_CANDIDATE_SET:
        out += [GemmConfig(bm, bn, bk, num_warps=w, num_stages=st, tma=True)
                for bm, bn, bk, w, st in _MID_DEEP_TILES]
    tails = tail_tiles(n, m)
    if tails and m > 256:
        extra = [GemmConfig(bm, bn, bk, num_warps=w, num_stages=st, tma=tma)
                 for bm, bn, bk, w, st in _LARGE_TAIL_TILES for tma in (False, True)]
        out += [c for c in extra if c.block_n in {bn for bn, _ in tails}]
    twins = [dataclasses.replace(c, block_n_tail=tail) for bn, tail in tails
             for c in out if c.block_n == bn and not c.stream_k_programs]
    if tails and _mid_m(m):
        twins = [fit_smem(twin, DTYPE.itemsize) for twin in twins]
        twins += [split for twin in twins if twin.tma and twin.split_k == 1
                  for split in wave_splits(twin, m, n, k)]
    out += twins
    if with_pool:
        out += BATCH_INVARIANT_POOL
    return list(dict.fromkeys(out))  # dedupe, keep order
