"""Multi-head latent attention (DeepSeek-V3 MLA): absorbed decode and expanded prefill. The cache
write, ``store_mla_kv``, is in kernels/kv_store.py.

Layouts:

- MLA cache per layer ``[num_blocks, block_size, latent_dim + rope_dim]`` (512 + 64 for V3): each
  token's normalised latent ``c`` followed by its roped ``k_pe``; ``block_tables`` [B, max_blocks]
  int32 maps a sequence's token t to block ``block_tables[b, t // block_size]``.
- ``mla_decode``: the absorbed form. ``q_latent`` [B, H, latent_dim] (q_nope times W_UK),
  ``q_pe`` [B, H, rope_dim]; score = scale * (q_latent.c + q_pe.k_pe), out = softmax . c in latent
  space [B, H, latent_dim]. All H heads share the one latent "kv head" (MQA).
- ``mla_prefill_attention``: the expanded form. q [T, H, Dqk], k [S, H, Dqk], v [S, H, Dv] dense,
  variable length (cu_seqlens_q / cu_seqlens_k), causal, bottom-right aligned: query i of sequence
  b sits at position k_len_b - q_len_b + i.

Invariance (DESIGN.md, "Three modes, one engine"):

- ``mla_decode`` under ``corun`` and ``batch_invariant``: each sequence's KV is split every
  ``split_size`` tokens, so its split boundaries and merge order depend on its own length only, and
  the grid is sized from the host int ``max_seq_len`` (max_model_len), never from the batch's
  contents. A sequence that is one split is written directly by the split kernel (no fp32
  partial; with a one-split grid the combine is not launched at all), a choice made from its own
  length, so its bits do not depend on the grid bound either. A sequence's output bits do not
  depend on the other sequences nor on its batch slot. Under ``default`` the split count is chosen
  from the batch size and the batch's longest sequence
  to fill the GPU, so a sequence's bits change with its co-runners (position-invariant only at a
  fixed batch).
- ``mla_prefill_attention``: one tile config per (head dims, dtype) in every mode and keys walked
  from key 0 in fixed BLOCK_N steps, so a query row's bits depend only on its own position and data:
  invariant to the other sequences, its row index and how its prompt was chunked. Tiles start at
  each sequence's own cu_seqlens offset, so a chunk packed into a step after other chunks (with
  zero-length padding rows and padding tokens after the last sequence, whose rows are written as
  zeros) gives the same bits as alone.

The Triton kernels are in kernels/mla_kernels.py; the tiles and their tuned table in
kernels/mla_tuned.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels.mla_kernels import (
    LOG2E,
    _mla_decode_combine_kernel,
    _mla_decode_kernel,
    _mla_prefill_kernel,
)
from kernels.mla_tuned import TUNED_PATH, MLATile, MLATunedTable, checked_in_table, load_mla_tuned
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
    next_power_of_2,
    preload_page_count,
    tma_addressable,
    upcast_dot_operands,
)

__all__ = [
    "TUNED_PATH",
    "MLADecodeConfig",
    "MLAPrefillConfig",
    "MLATile",
    "MLATunedTable",
    "load_mla_tuned",
    "mla_decode",
    "mla_decode_config",
    "preloaded_pages",
    "mla_prefill_attention",
    "mla_prefill_config",
]

# H200 streaming multiprocessors: the default-mode split heuristic fills them.
NUM_SMS = 132
# Default mode never splits below this many tokens per split (below it the combine dominates).
MIN_DEFAULT_SPLIT_TOKENS = 64


# ----------------------------------------------------------------------------------------------
# decode
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MLADecodeConfig:
    """Tile and split choices of one ``mla_decode`` launch."""

    block_h: int  # query heads per program (>= 16 rows for tl.dot)
    block_n: int  # cache tokens per inner step
    block_dv: int  # latent dim, padded to a power of 2
    block_r: int  # rope dim, padded to a power of 2
    dv_parts: int  # programs sharing a head block's output columns (fp32 acc [block_h, dv / parts])
    num_splits: int  # grid size along the KV axis
    split_size: int  # tokens per split when is_fixed_split
    is_fixed_split: bool
    num_warps: int
    num_stages: int
    preload_pages: bool = False  # MLATile.preload_pages; preloaded_pages sizes it per launch
    reload_values: bool = False  # MLATile.reload_values


def preloaded_pages(cfg: MLADecodeConfig, max_seq_len: int, page_size: int) -> int:
    """The kernel's SPLIT_PAGES: block ids a program loads before its token loop, a power of two
    covering every page one split can touch, or 0 (ids loaded tile by tile) when the tile does not
    preload or a split spans more than ``kernels.utils.MAX_PRELOAD_PAGES`` pages. A pure function
    of the launch's shapes; the bits are the same either way. Under default it relies on every
    sequence being at most ``max_seq_len`` long (``mla_decode``'s contract, checked for host
    tensors)."""
    if not cfg.preload_pages:
        return 0
    if cfg.is_fixed_split:
        split_len, aligned = cfg.split_size, cfg.split_size % page_size == 0
    else:  # the batch's longest sequence has the longest splits (kernels' _split_len)
        split_len = max(cdiv(cdiv(max_seq_len, cfg.num_splits), cfg.block_n) * cfg.block_n,
                        cfg.block_n)
        # Every sequence's splits start at multiples of its split length, itself a multiple of
        # the tile: on a page boundary where whole pages make up a tile.
        aligned = cfg.block_n % page_size == 0
    return preload_page_count(split_len, page_size, aligned)


def literal_decode_tile(num_heads: int, dtype: torch.dtype) -> MLATile:
    """The fallback tile (splits, head counts and contexts the tuned table lacks): up to 64 heads
    a program (two warp groups, each holding half of the [64, 512] fp32 accumulator) and 32-token
    steps in 3 stages, the tile the H200's table picked at every fixed split, context and batch it
    tuned (kernels/tuned/mla_h200.json, 2026-12-04: faster than 2 stages at every point, though
    compiled offline it spills registers, experiments/results/ptxas-mla-decode-sm90.json).
    4-byte elements halve the step and keep 2 stages, so their q tile and stages fit an SM."""
    block_h = min(64, max(16, next_power_of_2(num_heads)))
    narrow = dtype.itemsize <= 2
    return MLATile(
        block_m=block_h, block_n=32 if narrow else 16,
        num_warps=8 if block_h == 64 else 4, num_stages=3 if narrow else 2,
    )  # fmt: skip


def mla_decode_config(
    batch: int,
    num_heads: int,
    latent_dim: int,
    rope_dim: int,
    max_seq_len: int,
    dtype: torch.dtype,
    mode: Mode,
    split_size: int = 256,
    *,
    tile: MLATile | None = None,
    table: MLATunedTable | None = None,
) -> MLADecodeConfig:
    """The decode policy, a pure function of its arguments (and of the checked-in tuned table).

    ``corun`` / ``batch_invariant``: splits of exactly ``split_size`` tokens, ``num_splits`` =
    ceil(max_seq_len / split_size) (max_seq_len is max_model_len there, so it is a constant of the
    engine and only sizes the grid), and the tile from the table's entry for (num_heads,
    latent_dim, rope_dim, split_size, max_seq_len bucket, 16-bit dtype), else the literal tile:
    batch is never read. ``default``: the tile for (batch bucket, max_seq_len bucket), and
    ``num_splits`` from batch, num_heads, the tile's head block and value parts, and max_seq_len
    (the batch's longest) to fill the GPU with about one program per SM (a program's q tile and
    latent stages take most of an SM's shared memory), each split at least
    MIN_DEFAULT_SPLIT_TOKENS long: one split, and so no partial round trip, once the batch alone
    fills the SMs. ``tile`` overrides the lookup (tests and tuning), ``table`` the checked-in
    table (tests).
    """
    mode = Mode.parse(mode)
    if tile is None:
        tuned = (table or checked_in_table()).decode_tile(
            batch, num_heads, latent_dim, rope_dim, max_seq_len, dtype, mode, split_size
        )
        tile = tuned or literal_decode_tile(num_heads, dtype)
    _check_decode_tile(tile, latent_dim)
    block_h = tile.block_m
    block_dv = max(16, next_power_of_2(latent_dim))
    block_r = max(16, next_power_of_2(rope_dim))
    if mode == Mode.DEFAULT:
        programs = max(1, batch * cdiv(num_heads, block_h) * tile.dv_parts)
        wanted = max(1, NUM_SMS // programs)
        most = max(1, cdiv(max_seq_len, MIN_DEFAULT_SPLIT_TOKENS))
        num_splits, is_fixed = min(wanted, most), False
    else:
        num_splits, is_fixed = max(1, cdiv(max_seq_len, split_size)), True
    return MLADecodeConfig(
        block_h=block_h, block_n=tile.block_n, block_dv=block_dv, block_r=block_r,
        dv_parts=tile.dv_parts, num_splits=num_splits, split_size=split_size,
        is_fixed_split=is_fixed,
        num_warps=tile.num_warps, num_stages=tile.num_stages, preload_pages=tile.preload_pages,
        reload_values=tile.reload_values,
    )  # fmt: skip


def _check_decode_tile(tile: object, latent_dim: int) -> None:
    if not isinstance(tile, MLATile) or tile.block_m > 64 or tile.tma:
        raise ValueError(f"tile: expected an MLATile with block_m <= 64 and no tma, got {tile!r}")
    if max(16, next_power_of_2(latent_dim)) // tile.dv_parts < 16:
        raise ValueError(
            f"tile: dv_parts {tile.dv_parts} leaves fewer than 16 of the latent dim's "
            f"{latent_dim} columns to a program"
        )


# Heads per program of the split combine: a [8, 512] fp32 partial per split load.
COMBINE_BLOCK_H = 8


def mla_decode(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_seq_len: int,
    mode: Mode = Mode.CORUN,
    split_size: int = 256,
    tile: MLATile | None = None,
) -> torch.Tensor:
    """Absorbed MLA decode, one query token per sequence -> [B, H, latent_dim] in q's dtype.

    ``seq_lens`` [B] int32 counts each sequence's cached tokens (0 = padded dummy slot -> zeros);
    ``max_seq_len`` (host int) bounds them: max_model_len under corun / batch_invariant, the batch's
    longest under default. Numerics: ``kernels.reference.mla_decode_reference``. Invariance: see
    the module docstring. ``tile`` overrides the policy's tile (tests and tuning only; the split
    count stays the mode's).
    """
    mode = Mode.parse(mode)
    scale = check_softmax_scale(scale)
    check_tensor("q_latent", q_latent, ndim=3, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    check_tensor("q_pe", q_pe, ndim=3, dtypes=(q_latent.dtype,), last_dim_contiguous=True)
    check_tensor("kv_cache", kv_cache, ndim=3, dtypes=(q_latent.dtype,), last_dim_contiguous=True)
    check_tensor(
        "block_tables", block_tables, ndim=2, dtypes=(torch.int32,), last_dim_contiguous=True
    )
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,), contiguous=True)
    check_same_device(
        q_latent=q_latent,
        q_pe=q_pe,
        kv_cache=kv_cache,
        block_tables=block_tables,
        seq_lens=seq_lens,
    )
    batch, num_heads, latent_dim = q_latent.shape
    check_shape("q_pe", q_pe, (batch, num_heads, -1))
    rope_dim = q_pe.shape[2]
    if kv_cache.shape[2] != latent_dim + rope_dim:
        raise ValueError(
            f"kv_cache: last dim {kv_cache.shape[2]} != q_latent's latent dim {latent_dim} + "
            f"q_pe's rope dim {rope_dim}"
        )
    check_shape("block_tables", block_tables, (batch, -1))
    check_shape("seq_lens", seq_lens, (batch,))
    if not isinstance(max_seq_len, int) or max_seq_len < 0:
        raise ValueError(f"max_seq_len: expected a non-negative int, got {max_seq_len!r}")
    if not isinstance(split_size, int) or split_size < 16:
        raise ValueError(f"split_size: expected an int >= 16, got {split_size!r}")
    if tile is not None:
        _check_decode_tile(tile, latent_dim)
    capacity = block_tables.shape[1] * kv_cache.shape[1]
    if max_seq_len > capacity:
        raise ValueError(f"max_seq_len: {max_seq_len} exceeds the block table's {capacity} tokens")
    if is_host_checkable(seq_lens) and batch > 0:
        longest, shortest = int(seq_lens.max()), int(seq_lens.min())
        if longest > max_seq_len or shortest < 0:
            raise ValueError(
                f"seq_lens: values must lie in [0, max_seq_len={max_seq_len}], got "
                f"[{shortest}, {longest}]"
            )
        check_block_ids(block_tables, seq_lens, kv_cache.shape[1], kv_cache.shape[0])

    out = torch.empty_like(q_latent)
    if batch == 0 or num_heads == 0:
        return out
    cfg = mla_decode_config(
        batch, num_heads, latent_dim, rope_dim, max_seq_len, q_latent.dtype, mode, split_size,
        tile=tile,
    )  # fmt: skip
    if cfg.num_splits > 1:
        mid_out = torch.empty((batch, num_heads, cfg.num_splits, latent_dim),
                              dtype=torch.float32, device=q_latent.device)  # fmt: skip
        mid_lse = torch.empty((batch, num_heads, cfg.num_splits), dtype=torch.float32,
                              device=q_latent.device)  # fmt: skip
    else:  # every sequence is one split and writes ``out`` directly: no partials, no combine
        mid_out = mid_lse = out.new_empty((1, 1, 1), dtype=torch.float32)
    grid = (cdiv(num_heads, cfg.block_h) * cfg.dv_parts, batch, cfg.num_splits)
    _mla_decode_kernel[grid](
        q_latent, q_pe, kv_cache, block_tables, seq_lens, out, mid_out, mid_lse,
        # split size 0 selects default's spread-over-num_splits rule (one compiled kernel)
        num_heads, cfg.split_size if cfg.is_fixed_split else 0, cfg.num_splits, scale * LOG2E,
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1),
        mid_out.stride(0), mid_out.stride(1), mid_out.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        LATENT_DIM=latent_dim, ROPE_DIM=rope_dim, PAGE_SIZE=kv_cache.shape[1],
        BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, BLOCK_DV=cfg.block_dv, BLOCK_R=cfg.block_r,
        UPCAST=upcast_dot_operands(q_latent.dtype),
        DOT_PRECISION=dot_precision(q_latent.dtype), DV_PARTS=cfg.dv_parts,
        SPLIT_PAGES=preloaded_pages(cfg, max_seq_len, kv_cache.shape[1]),
        RELOAD_VALUES=cfg.reload_values,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if cfg.num_splits > 1:
        _mla_decode_combine_kernel[(batch, cdiv(num_heads, COMBINE_BLOCK_H))](
            mid_out, mid_lse, seq_lens, out,
            num_heads, cfg.split_size if cfg.is_fixed_split else 0, cfg.num_splits,
            mid_out.stride(0), mid_out.stride(1), mid_out.stride(2),
            mid_lse.stride(0), mid_lse.stride(1), out.stride(0), out.stride(1),
            LATENT_DIM=latent_dim, BLOCK_HC=COMBINE_BLOCK_H, BLOCK_N=cfg.block_n,
            BLOCK_DV=cfg.block_dv, num_warps=4,
        )  # fmt: skip
    return out


# ----------------------------------------------------------------------------------------------
# prefill
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MLAPrefillConfig:
    """Tile choices of one ``mla_prefill_attention`` launch."""

    block_m: int
    block_n: int
    block_d1: int  # first power-of-2 part of the qk head dim (128 of 192)
    block_d2: int  # the rest, padded to a power of 2 >= 16 (64 of 192); 0 when Dqk is a power of 2
    block_dv: int
    num_warps: int
    num_stages: int
    tma: bool = False  # key and value tiles through TMA descriptors (where the layout allows)


def mla_prefill_config(
    qk_dim: int, v_dim: int, dtype: torch.dtype, mode: Mode, *, tile: MLATile | None = None,
    table: MLATunedTable | None = None,
) -> MLAPrefillConfig:
    """The prefill policy: a pure function of the head dims and dtype, the same in every mode.

    It never reads the batch, the chunk lengths or the context lengths, which (with keys walked
    from key 0) makes a row's bits independent of chunking and co-runners. The tile comes from the
    tuned table's entry for (qk_dim, v_dim) for 16-bit dtypes, else from the literal rule below;
    ``tile`` overrides the lookup (tests and tuning), ``table`` the checked-in table (tests).
    """
    Mode.parse(mode)
    block_d1 = 1 << (max(qk_dim, 1).bit_length() - 1)  # largest power of 2 <= qk_dim
    rest = qk_dim - block_d1
    block_d2 = max(16, next_power_of_2(rest)) if rest > 0 else 0
    block_d1 = max(16, block_d1)
    wide = dtype.itemsize > 2
    if tile is not None and (not isinstance(tile, MLATile) or tile.has_decode_options):
        raise ValueError(f"tile: expected an MLATile with dv_parts 1 and no preload_pages or "
                         f"reload_values (decode only), got {tile!r}")
    tile = tile or (table or checked_in_table()).prefill_tile(qk_dim, v_dim, dtype) or MLATile(
        block_m=64 if wide else 128, block_n=32 if wide else 64,
        num_warps=4 if wide else 8, num_stages=2 if wide else 3,
    )  # fmt: skip
    return MLAPrefillConfig(
        block_m=tile.block_m, block_n=tile.block_n, block_d1=block_d1,
        block_d2=block_d2, block_dv=max(16, next_power_of_2(v_dim)),
        num_warps=tile.num_warps, num_stages=tile.num_stages, tma=tile.tma,
    )  # fmt: skip


def mla_prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    scale: float,
    *,
    max_q_len: int,
    mode: Mode = Mode.CORUN,
    config: MLAPrefillConfig | None = None,
) -> torch.Tensor:
    """Dense varlen causal attention with qk dim != v dim -> [T, H, Dv] in q's dtype.

    q [T, H, Dqk], k [S, H, Dqk], v [S, H, Dv]; ``cu_seqlens_q`` / ``cu_seqlens_k`` [B + 1] int32
    delimit each sequence's queries and keys (k_len_b >= q_len_b); ``max_q_len`` (host int) is the
    longest chunk and sizes the grid only. Query i of sequence b sees keys
    0 .. k_len_b - q_len_b + i.
    Packed steps: a sequence of q_len 0 (and k_len 0) is a padding slot; rows of q after
    cu_seqlens_q[-1] belong to no sequence and give zeros (k and v may likewise hold rows after
    cu_seqlens_k[-1], never read). No host sync on GPU tensors (CUDA-graph capturable).
    ``config`` overrides the policy (tests and tuning only; the engine never passes it).
    """
    mode = Mode.parse(mode)
    scale = check_softmax_scale(scale)
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    check_tensor("k", k, ndim=3, dtypes=(q.dtype,), last_dim_contiguous=True)
    check_tensor("v", v, ndim=3, dtypes=(q.dtype,), last_dim_contiguous=True)
    check_tensor("cu_seqlens_q", cu_seqlens_q, ndim=1, dtypes=(torch.int32,), contiguous=True)
    check_tensor("cu_seqlens_k", cu_seqlens_k, ndim=1, dtypes=(torch.int32,), contiguous=True)
    check_same_device(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    num_tokens, num_heads, qk_dim = q.shape
    v_dim = v.shape[2]
    check_shape("k", k, (-1, num_heads, qk_dim))
    check_shape("v", v, (k.shape[0], num_heads, -1))
    if cu_seqlens_q.shape[0] < 1:
        raise ValueError("cu_seqlens_q: expected B + 1 >= 1 entries")
    check_shape("cu_seqlens_k", cu_seqlens_k, (cu_seqlens_q.shape[0],))
    if not isinstance(max_q_len, int) or max_q_len < 0:
        raise ValueError(f"max_q_len: expected a non-negative int, got {max_q_len!r}")
    batch = cu_seqlens_q.shape[0] - 1
    if is_host_checkable(cu_seqlens_q):
        _check_prefill_lengths(cu_seqlens_q.tolist(), cu_seqlens_k.tolist(), num_tokens,
                               k.shape[0], max_q_len)

    out = torch.empty((num_tokens, num_heads, v_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_heads == 0:
        return out
    cfg = config or mla_prefill_config(qk_dim, v_dim, q.dtype, mode)
    # At least one tile lane, so that a step of padding only still gets its zeros; sequence index
    # ``batch`` is the padding program (rows cu_seqlens_q[-1] .. T - 1).
    num_m_tiles = max(1, cdiv(max_q_len, cfg.block_m))
    grid = (num_m_tiles, num_heads, batch + 1)
    # Descriptors over [S, H, D]: a box of BLOCK_N rows of one head, zero-filled past S and past
    # the head dim; a layout TMA cannot address takes the pointer loads with the same tiles.
    use_tma = cfg.tma and k.shape[0] > 0 and tma_addressable(k) and tma_addressable(v)
    k1_arg = _descriptor(k, cfg.block_n, cfg.block_d1) if use_tma else k
    k2_arg = _descriptor(k, cfg.block_n, cfg.block_d2) if use_tma and cfg.block_d2 else k1_arg
    v_arg = _descriptor(v, cfg.block_n, cfg.block_dv) if use_tma else v
    _mla_prefill_kernel[grid](
        q, k1_arg, k2_arg, v_arg, out, cu_seqlens_q, cu_seqlens_k,
        num_tokens, batch, num_m_tiles, scale * LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        QK_DIM=qk_dim, V_DIM=v_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_D1=cfg.block_d1, BLOCK_D2=cfg.block_d2, BLOCK_DV=cfg.block_dv,
        UPCAST=upcast_dot_operands(q.dtype), DOT_PRECISION=dot_precision(q.dtype), TMA=use_tma,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out


def _descriptor(t: torch.Tensor, rows: int, cols: int) -> TensorDescriptor:
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [rows, 1, cols])


def _check_prefill_lengths(
    cu_q: list[int], cu_k: list[int], num_q_rows: int, num_k_rows: int, max_q_len: int
) -> None:
    """CPU only: offsets start at 0, never decrease, end within q / k (rows after the end are a
    packed step's padding), and every sequence has at least as many keys as queries."""
    q_lens = [b - a for a, b in zip(cu_q, cu_q[1:], strict=False)]
    k_lens = [b - a for a, b in zip(cu_k, cu_k[1:], strict=False)]
    if cu_q[0] != 0 or min(q_lens, default=0) < 0 or cu_q[-1] > num_q_rows:
        raise ValueError(
            f"cu_seqlens_q: expected non-decreasing offsets from 0 to at most {num_q_rows}, "
            f"got {cu_q}"
        )
    if cu_k[0] != 0 or min(k_lens, default=0) < 0 or cu_k[-1] > num_k_rows:
        raise ValueError(
            f"cu_seqlens_k: expected non-decreasing offsets from 0 to at most {num_k_rows}, "
            f"got {cu_k}"
        )
    if any(kl < ql for ql, kl in zip(q_lens, k_lens, strict=True)):
        raise ValueError(f"cu_seqlens_k: a sequence has fewer keys {k_lens} than queries {q_lens}")
    if max(q_lens, default=0) > max_q_len:
        raise ValueError(f"max_q_len: {max_q_len} is below the longest chunk {max(q_lens)}")
