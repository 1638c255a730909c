"""GEMM ``y = x @ w.T (+ bias)``: x [M, K], w [N, K] (nn.Linear layout), fp16/bf16/fp32 in, fp32
accumulation, output in x's dtype. The jit kernels live in ``gemm_kernels.py``.

Invariance, by mode (DESIGN.md, "The two properties"):

- every mode is **position-invariant**: at a fixed (M, N, K) a row's bits depend only on its own
  data, never on its row index or the other rows. The config is a pure function of the shape, a
  row's K walk is fixed by (block_k, split_k) or, under stream-K, by where the programs' equal
  shares cut its column tile (a function of N, K, the tiles and ``stream_k_programs``; one row
  tile, so the same cuts for every row), and partials are summed in order.
- ``batch_invariant`` is also **batch-invariant**: one config for every M (its policy never reads
  M), no split-K, so a row's reduction order is the same at every batch size.
- ``batch_invariant_tuned`` is batch-invariant on the hardware its table was tuned on: tiles per
  (M, N, K) with split-K off. On the H200 a row's bits depend on split-K only (BLOCK_K and the
  tile shape do not change them: the MMA accumulates a K tile in one order; checked at real shapes
  across M by ``tests/engine/test_gpu_engine.py``). Shapes without a tuned entry
  take the literal tiles with BLOCK_K pinned to the portable policy's, which is batch-invariant
  everywhere (the interpreter included).
- ``default`` and ``corun`` pick the fastest config per shape (block_k and split-K chosen by M), so
  a row's bits may change with M; corun gets determinism by fixing M (isolated prefill, padded
  decode), default does not.

The tuned configs are per card (``kernels/tuned/gemm_<card>.json``, ``kernels.utils.device_card``
of the tensors' device): the H200's table is the base every card starts from, and another card's
file holds the points tuned on that card, which replace the H200's at the same (M, N, K). A config
stays a pure function of (shape, dtype, mode, card); one card runs one config per shape, so its
bits are reproducible on that card, as any kernel's are only on the hardware that ran it.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels.gemm_kernels import _gemm_kernel, _splitk_reduce_kernel
from kernels.gemm_tuned import (
    GemmConfig,
    TunedTable,
    load_tuned_table,
    overlay,
    table_files,
    tuned_path,
)
from kernels.mode import Mode
from kernels.reference import gemm_reference
from kernels.utils import (
    FLOAT_DTYPES,
    cdiv,
    check_same_device,
    check_shape,
    check_tensor,
    device_card,
    dot_precision,
    is_interpreter,
    next_power_of_2,
    tma_addressable,
    upcast_dot_operands,
)

__all__ = ["GemmConfig", "TunedTable", "gemm", "gemm_config", "gemm_reference", "load_tuned_table",
           "overlay", "table_files", "tuned_path"]

# H200 facts the literal fallback policy is reasoned from.
H200_NUM_SMS = 132
# Two CTAs per SM: small-M GEMMs stream the weights, and one CTA per SM cannot keep enough loads
# in flight to reach HBM bandwidth.
TARGET_NUM_CTAS = 2 * H200_NUM_SMS
MAX_SPLIT_K = 16
# A split of one K block leaves the software pipeline nothing to overlap.
MIN_K_BLOCKS_PER_SPLIT = 2
# Elements one reduce program sums (REDUCE_ELEMENTS // block_n rows of one column tile).
REDUCE_ELEMENTS = 1024
# Per-CTA shared memory the pipeline may use (H200: 227 KB per block; keep room for the epilogue).
SMEM_BUDGET_BYTES = 200 * 1024


# ----------------------------------------------------------------------------------------------
# tuned tables: kernels/tuned/gemm_<card>.json (kernels/gemm_tuned.py), written by
# experiments/tune_gemm.py
# ----------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def _tuned_table(card: str | None = None) -> TunedTable:
    """The table a card runs: each of ``table_files`` overlaid on the one before."""
    return functools.reduce(overlay, map(load_tuned_table, table_files(card)))


# ----------------------------------------------------------------------------------------------
# config policy
# ----------------------------------------------------------------------------------------------

# The batch-invariant baseline: one tile for every M (128x128x64, 8 warps, persistent), the shape
# batch_invariant_ops-style kernels use. Overridden by the tuned file's single choice if present.
_BATCH_INVARIANT_16BIT = GemmConfig(128, 128, 64, split_k=1, group_m=8, num_warps=8,
                                    num_stages=4, persistent=True)


def fit_smem(config: GemmConfig, itemsize: int) -> GemmConfig:
    """Drop pipeline stages until the config fits in shared memory (never changes bits)."""
    while config.num_stages > 1 and config.smem_bytes(itemsize) > SMEM_BUDGET_BYTES:
        config = dataclasses.replace(config, num_stages=config.num_stages - 1)
    return config


def _for_dtype(config: GemmConfig, dtype: torch.dtype) -> GemmConfig:
    """Tables are for 16-bit inputs; fp32 tiles take half the K depth to keep the same bytes."""
    if dtype == torch.float32 and config.block_k > 16:
        config = dataclasses.replace(config, block_k=config.block_k // 2)
    return fit_smem(config, dtype.itemsize)


def auto_split_k(m: int, n: int, k: int, block_m: int, block_n: int, block_k: int) -> int:
    """Split-K count that lifts a small-M GEMM to ~TARGET_NUM_CTAS programs.

    Capped so each split keeps MIN_K_BLOCKS_PER_SPLIT K blocks, by MAX_SPLIT_K, and so the fp32
    workspace round trip (2 * split * M * N * 4 bytes) stays under 1/8 of the 16-bit weight bytes
    (N * K * 2): split <= K / (32 * M). Large M never splits.
    """
    num_tiles = cdiv(m, block_m) * cdiv(n, block_n)
    k_blocks = cdiv(k, block_k)
    split = min(TARGET_NUM_CTAS // max(num_tiles, 1), k_blocks // MIN_K_BLOCKS_PER_SPLIT,
                MAX_SPLIT_K, k // (32 * max(m, 1)))
    if split <= 1:
        return 1
    split = 1 << (split.bit_length() - 1)  # a power of two: fewer distinct configs to tune
    return cdiv(k_blocks, cdiv(k_blocks, split))  # no empty splits


def _fallback_config(m: int, n: int, k: int) -> GemmConfig:
    """Literal H200 table for 16-bit inputs, used for shapes the tuned file does not cover.

    Small M (decode) streams the weights: narrow N tiles, deep K tiles, split-K when the tiles
    alone leave SMs idle. Large M is compute bound: big tiles, the largest that still fills the
    132 SMs.
    """
    if m <= 64:
        tile = GemmConfig(max(16, next_power_of_2(m)), 64, 128, num_warps=4, num_stages=4)
    elif m <= 128:
        tile = GemmConfig(64, 128, 64, num_warps=4, num_stages=4)
    elif m <= 256:
        tile = GemmConfig(128, 128, 64, num_warps=8, num_stages=4)
    else:
        options = (GemmConfig(128, 256, 64, num_warps=8, num_stages=3),
                   GemmConfig(128, 128, 64, num_warps=8, num_stages=4),
                   GemmConfig(64, 128, 64, num_warps=4, num_stages=4))
        tile = next((c for c in options
                     if cdiv(m, c.block_m) * cdiv(n, c.block_n) >= H200_NUM_SMS), options[-1])
    return tile


def gemm_config(m: int, n: int, k: int, dtype: torch.dtype, mode: Mode | str,
                card: str | None = None) -> GemmConfig:
    """The config ``gemm`` runs for x [m, k] @ w[n, k].T on ``card`` (``kernels.utils.device_card``
    of the tensors' device: ``gemm`` passes it; None, the interpreter's, reads the H200's table);
    a pure function of its arguments.

    - ``batch_invariant``: depends on dtype only (never on m, n or k); no split-K.
    - ``batch_invariant_tuned``: depends on (m, n, k, dtype), never split-K: the tuned no-split
      entry, else the literal tile with the portable policy's BLOCK_K.
    - ``default`` / ``corun``: depends on (m, n, k, dtype): the tuned entry for (n, k) at the
      smallest tuned M >= m, else the literal fallback with split-K from ``auto_split_k``.

    Cached: a pure function of hashable arguments, computed once per shape.
    """
    return _gemm_config(_tuned_table(card), m, n, k, dtype, Mode.parse(mode))


@functools.lru_cache(maxsize=4096)
def _gemm_config(table: TunedTable, m: int, n: int, k: int, dtype: torch.dtype,
                 mode: Mode) -> GemmConfig:
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype: expected one of {FLOAT_DTYPES}, got {dtype}")
    if m < 1 or n < 1 or k < 0:
        raise ValueError(f"shape: expected m >= 1, n >= 1, k >= 0, got ({m}, {n}, {k})")
    portable = table.batch_invariant or _BATCH_INVARIANT_16BIT
    if mode is Mode.BATCH_INVARIANT:  # never a function of m, so never masked
        return _for_dtype(portable, dtype)
    return with_row_mask(_m_dependent_config(table, portable, m, n, k, dtype, mode), m)


def _m_dependent_config(table: TunedTable, portable: GemmConfig, m: int, n: int, k: int,
                        dtype: torch.dtype, mode: Mode) -> GemmConfig:
    """The tile of every mode but ``batch_invariant``, before ``with_row_mask``."""
    if mode is Mode.BATCH_INVARIANT_TUNED:
        tuned = table.lookup(m, n, k, dtype, no_split=True)
        if tuned is not None:
            return fit_smem(tuned, dtype.itemsize)
        tile = dataclasses.replace(_fallback_config(m, n, k), block_k=portable.block_k)
        return _for_dtype(tile, dtype)
    tuned = table.lookup(m, n, k, dtype)
    if tuned is not None:
        return fit_smem(tuned, dtype.itemsize)
    config = _for_dtype(_fallback_config(m, n, k), dtype)
    split = auto_split_k(m, n, k, config.block_m, config.block_n, config.block_k)
    return dataclasses.replace(config, split_k=split)


def with_row_mask(config: GemmConfig, m: int) -> GemmConfig:
    """Masked rows (``GemmConfig.mask_rows``) where M leaves the one row tile part empty.

    Speed only, never bits. TMA tiles already read zeros past M, so they keep their loads.
    """
    return dataclasses.replace(config, mask_rows=m < config.block_m and not config.tma)


# ----------------------------------------------------------------------------------------------
# launcher
# ----------------------------------------------------------------------------------------------


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter: a few programs, so the persistent loop really loops in tests


def gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    mode: Mode | str = Mode.CORUN,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """``x @ w.T (+ bias)`` in x's dtype with fp32 accumulation.

    ``config`` overrides the policy (tests and tuning); otherwise ``gemm_config`` picks it from
    the shape and ``mode``. See the module docstring for which invariance each mode keeps.
    """
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("w", w, ndim=2, dtypes=(x.dtype,))
    if w.shape[1] != x.shape[1]:
        raise ValueError(f"w: expected K = {x.shape[1]} (x.shape[1]), got shape {tuple(w.shape)}")
    m, k = x.shape
    n = w.shape[0]
    if bias is not None:
        check_tensor("bias", bias, ndim=1, dtypes=FLOAT_DTYPES, contiguous=True)
        check_shape("bias", bias, (n,))
        device = check_same_device(x=x, w=w, bias=bias)
    else:
        device = check_same_device(x=x, w=w)
    mode = Mode.parse(mode)
    if config is not None and not isinstance(config, GemmConfig):
        raise ValueError(f"config: expected a GemmConfig, got {type(config).__name__}")

    out = torch.empty((m, n), dtype=x.dtype, device=device)
    if m == 0 or n == 0:
        return out
    cfg = config if config is not None else gemm_config(m, n, k, x.dtype, mode,
                                                         card=device_card(device))

    k_blocks = cdiv(k, cfg.block_k)
    stream_k = cfg.stream_k_programs > 0 and k_blocks > 0
    if stream_k and m > cfg.block_m:
        raise ValueError(f"config: stream-K runs one row tile; expected M <= block_m "
                         f"{cfg.block_m}, got M {m}")
    bias_arg = bias if bias is not None else out  # never read when HAS_BIAS is False
    if stream_k:
        programs = stream_k_programs(n, k, cfg)
        slots = stream_k_pieces(n, k, cfg)  # the most pieces a column tile is cut into
        workspace = (torch.empty((slots, m, n), dtype=torch.float32, device=device)
                     if slots > 1 else out)
        grid, split_k, k_blocks_per_split = (programs,), slots, k_blocks
    else:
        k_blocks_per_split = max(1, cdiv(k_blocks, cfg.split_k))
        split_k = max(1, cdiv(k_blocks, k_blocks_per_split))  # no empty splits
        workspace = (torch.empty((split_k, m, n), dtype=torch.float32, device=device)
                     if split_k > 1 else out)
        num_work = cdiv(m, cfg.block_m) * cdiv(n, cfg.tile_n) * split_k
        grid = (min(num_work, _num_sms(device)) if cfg.persistent else num_work,)
    use_workspace = split_k > 1
    # A layout TMA cannot address (a view with a 2-byte-aligned row stride, say) takes the
    # per-thread loads with the same tiles: the same arithmetic, so the same bits.
    use_tma = cfg.tma and k > 0 and tma_addressable(x) and tma_addressable(w)
    x_arg = TensorDescriptor.from_tensor(x, [cfg.block_m, cfg.block_k]) if use_tma else x
    w_arg = TensorDescriptor.from_tensor(w, [cfg.block_n, cfg.block_k]) if use_tma else w
    w_tail_arg = (TensorDescriptor.from_tensor(w, [cfg.block_n_tail, cfg.block_k])
                  if use_tma and cfg.block_n_tail else w_arg)  # read only with a tail

    _gemm_kernel[grid](
        x_arg, w_arg, w_tail_arg, bias_arg, out, workspace,
        m, n, k, split_k, k_blocks_per_split,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), m * n, out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None and (stream_k or not use_workspace),
        USE_WORKSPACE=use_workspace,
        STREAM_K=stream_k,
        EVEN_K=k % cfg.block_k == 0,
        UPCAST=upcast_dot_operands(x.dtype),
        SERIAL_DOT=is_interpreter(),
        DOT_PRECISION=dot_precision(x.dtype),
        TMA=use_tma,
        MASK_ROWS=cfg.mask_rows,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_N_TAIL=cfg.block_n_tail,
        BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if use_workspace:
        reduce_partials(workspace, bias, out, k, split_k, grid[0] if stream_k else 0, cfg)
    return out


def reduce_partials(workspace: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
                    k: int, slots: int, stream_k_programs: int, config: GemmConfig) -> None:
    """Sum the fp32 partials of ``workspace`` [slots, M, N] into ``out`` (+ bias) in slot order:
    split-K's ``slots`` splits everywhere, or, with ``stream_k_programs`` > 0, the pieces of each
    column tile that stream-K cut (a tile of one piece is already in ``out``)."""
    m, n = out.shape
    reduce_rows = max(1, REDUCE_ELEMENTS // config.block_n)
    _splitk_reduce_kernel[(cdiv(m, reduce_rows), cdiv(n, config.block_n))](
        workspace, bias if bias is not None else out, out,
        m, n, k, slots, stream_k_programs,
        m * n, out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, STREAM_K=stream_k_programs > 0,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, REDUCE_ROWS=reduce_rows,
        num_warps=4,
    )


def stream_k_programs(n: int, k: int, config: GemmConfig) -> int:
    """The programs a stream-K launch runs: ``config.stream_k_programs``, or the iteration count
    (column tiles x K blocks) where that is smaller, so every program holds at least one
    iteration (a program without one would leave its workspace slot unwritten, and the reduce
    would sum it). A function of the shape and the config only, like the cuts it sets."""
    return max(1, min(config.stream_k_programs,
                      cdiv(n, config.block_n) * cdiv(k, config.block_k)))


@functools.lru_cache(maxsize=1024)
def stream_k_pieces(n: int, k: int, config: GemmConfig) -> int:
    """The most pieces stream-K cuts one column tile's K walk into (the workspace's slots):
    program p of P (``stream_k_programs``) holds iterations [p * total // P, (p + 1) * total //
    P) of the (column tile, K block) space, and a tile's pieces are the programs its iterations
    span."""
    k_blocks = cdiv(k, config.block_k)
    tiles = cdiv(n, config.block_n)
    total = tiles * k_blocks
    if config.stream_k_programs < 1 or total == 0:
        return 1
    programs = stream_k_programs(n, k, config)

    def program_of(iteration: int) -> int:
        return ((iteration + 1) * programs - 1) // total

    return max(program_of((t + 1) * k_blocks - 1) - program_of(t * k_blocks) + 1
               for t in range(tiles))
