"""Rotary position embedding (neox rotate-half and GPT-J interleaved) and its cos/sin cache.

``rope(q [T, Hq, R], k [T, Hk, R], positions [T], cos_sin_cache [P, R], is_neox)`` rotates every
head of token t by the angles of ``positions[t]``. ``is_neox`` pairs (i, i + R/2) as Qwen3 does;
otherwise GPT-J pairs (2i, 2i + 1) as DeepSeek-V3 (``rope_interleave``). q and k may be strided
views (e.g. the rope part of DeepSeek's q [T, H, 192]) with a contiguous last dim; the rotation is
out of place (new contiguous tensors) or in place.

``build_rope_cache`` makes the [P, R] cache once in plain torch (cos half | sin half), YaRN
included with its attention factor folded into cos/sin, following transformers'
``_compute_yarn_parameters`` (correction range from ``original_max_position_embeddings``).

A program rotates a [heads, R] tile (BLOCK_H heads; the full rotary dim, loaded contiguously and
split into even/odd lanes for GPT-J pairs, or as two contiguous halves for neox) for each of
BLOCK_T tokens; the grid is (token blocks, head tiles of q then of k), so DeepSeek's 128 heads
spread over several programs and a program moves several tokens.

Invariance: elementwise, with no reduction: every element of a token gets the same instructions
whatever tile or token block holds it, so its bits depend only on its own q/k and position under
every mode and every config: position- and batch-invariant in ``default``, ``batch_invariant``
and ``corun``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.mode import Mode
from kernels.utils import (
    FLOAT_DTYPES,
    cdiv,
    check_same_device,
    check_shape,
    check_tensor,
    next_power_of_2,
)


@triton.jit
def _rope_rotate_tile(
    in_ptr,
    out_ptr,
    positions_ptr,
    cache_ptr,
    token0,
    num_tokens,
    n_heads,
    half,
    stride_in_t,
    stride_in_h,
    stride_out_t,
    stride_out_h,
    stride_cache_p,
    IS_NEOX: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Rotate a [BLOCK_H heads, rotary dim] tile of each of BLOCK_T tokens from ``token0``
    (``in_ptr``/``out_ptr`` already point at the tile's first head)."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)  # pair index i < R/2
    mask_h = offs_h < n_heads
    mask_d = offs_d < half
    if IS_NEOX:
        # pairs (i, i + R/2): two contiguous half tiles
        mask_cols = mask_d
        offs_1 = offs_h[:, None] * stride_in_h + offs_d[None, :]
        offs_out_1 = offs_h[:, None] * stride_out_h + offs_d[None, :]
    else:
        # pairs (2i, 2i + 1): one contiguous [heads, R] tile, split into even/odd lanes
        offs_r = tl.arange(0, 2 * BLOCK_D)
        mask_cols = offs_r < 2 * half
        offs_1 = offs_h[:, None] * stride_in_h + offs_r[None, :]
        offs_out_1 = offs_h[:, None] * stride_out_h + offs_r[None, :]
    for t in range(BLOCK_T):
        token = token0 + t
        # Past-the-end tokens of the last block: a clamped (valid) position and a row mask (the
        # interpreter cannot AND a tile with a scalar).
        pos = tl.load(positions_ptr + tl.minimum(token, num_tokens - 1)).to(tl.int64)
        cache_row = cache_ptr + pos * stride_cache_p
        cos = tl.load(cache_row + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        sin = tl.load(cache_row + half + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        src = in_ptr + token * stride_in_t
        dst = out_ptr + token * stride_out_t
        rows = mask_h & (offs_h * 0 + token < num_tokens)
        m = rows[:, None] & mask_cols[None, :]
        if IS_NEOX:
            x1 = tl.load(src + offs_1, mask=m, other=0.0).to(tl.float32)
            x2 = tl.load(src + offs_1 + half, mask=m, other=0.0).to(tl.float32)
            o1 = x1 * cos[None, :] - x2 * sin[None, :]
            o2 = x2 * cos[None, :] + x1 * sin[None, :]
            tl.store(dst + offs_out_1, o1.to(out_ptr.dtype.element_ty), mask=m)
            tl.store(dst + offs_out_1 + half, o2.to(out_ptr.dtype.element_ty), mask=m)
        else:
            x = tl.load(src + offs_1, mask=m, other=0.0).to(tl.float32)
            x1, x2 = tl.split(tl.reshape(x, [BLOCK_H, BLOCK_D, 2]))
            o1 = x1 * cos[None, :] - x2 * sin[None, :]
            o2 = x2 * cos[None, :] + x1 * sin[None, :]
            o = tl.reshape(tl.join(o1, o2), [BLOCK_H, 2 * BLOCK_D])
            tl.store(dst + offs_out_1, o.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _rope_kernel(
    # pointers
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    positions_ptr,
    cache_ptr,
    # sizes
    num_tokens,
    n_q_heads,
    n_k_heads,
    half,
    n_q_tiles,
    # strides
    stride_q_t,
    stride_q_h,
    stride_k_t,
    stride_k_h,
    stride_qo_t,
    stride_qo_h,
    stride_ko_t,
    stride_ko_h,
    stride_cache_p,
    # meta
    IS_NEOX: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # Axis 0: a block of BLOCK_T tokens; axis 1: a tile of BLOCK_H heads, q's tiles then k's.
    token0 = tl.program_id(0).to(tl.int64) * BLOCK_T
    tile = tl.program_id(1)
    if tile < n_q_tiles:
        h0 = tile * BLOCK_H
        _rope_rotate_tile(
            q_ptr + h0 * stride_q_h, q_out_ptr + h0 * stride_qo_h, positions_ptr, cache_ptr,
            token0, num_tokens, n_q_heads - h0, half,
            stride_q_t, stride_q_h, stride_qo_t, stride_qo_h, stride_cache_p,
            IS_NEOX, BLOCK_T, BLOCK_H, BLOCK_D,
        )
    else:
        h0 = (tile - n_q_tiles) * BLOCK_H
        _rope_rotate_tile(
            k_ptr + h0 * stride_k_h, k_out_ptr + h0 * stride_ko_h, positions_ptr, cache_ptr,
            token0, num_tokens, n_k_heads - h0, half,
            stride_k_t, stride_k_h, stride_ko_t, stride_ko_h, stride_cache_p,
            IS_NEOX, BLOCK_T, BLOCK_H, BLOCK_D,
        )


@dataclass(frozen=True)
class RopeConfig:
    """Half the rotary dim padded to a power of two, heads per tile, tokens per program, warps."""

    BLOCK_D: int
    BLOCK_H: int
    BLOCK_T: int
    num_warps: int


@functools.lru_cache(maxsize=256)
def rope_config(
    num_tokens: int,
    num_q_heads: int,
    num_k_heads: int,
    rotary_dim: int,
    dtype: torch.dtype,
    mode: Mode = Mode.CORUN,
) -> RopeConfig:
    """Pure policy of the token count, head counts and rotary dim; the same for every mode.

    May read the token count because the op is elementwise: every element gets the same
    instructions whatever tile or token block it sits in, so any config gives the same bits (the
    invariance tests compare a token alone, i.e. another config, with the token in a batch).
    A program rotates tiles of up to 4096 elements ([64 heads, 64] at DeepSeek's rope, [32, 64
    pairs] at Qwen3's neox halves, as before) for 4 tokens once that still leaves >= 512
    programs (about 4 per SM of an H200), else for 1.
    """
    del dtype, mode
    block_d = next_power_of_2(max(rotary_dim // 2, 1))
    tile_rows = max(1, 4096 // (2 * block_d))
    block_h = min(next_power_of_2(max(num_q_heads, num_k_heads)), tile_rows)
    tiles = cdiv(num_q_heads, block_h) + cdiv(num_k_heads, block_h)
    block_t = 4 if cdiv(num_tokens, 4) * tiles >= 512 else 1
    num_warps = 4 if block_h * block_d <= 1024 else 8
    return RopeConfig(BLOCK_D=block_d, BLOCK_H=block_h, BLOCK_T=block_t, num_warps=num_warps)


def rope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    *,
    inplace: bool = False,
    mode: Mode = Mode.CORUN,
    config: RopeConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, R] and k [T, Hk, R] by ``positions`` [T] (int32/int64, < P).

    Returns (q, k) themselves when ``inplace``, else new contiguous tensors. Position- and
    batch-invariant under every mode. Positions are not range-checked on the device (that would
    synchronise); an out-of-range position reads outside the cache. ``config`` overrides the
    policy (tests, benchmarks).
    """
    mode = Mode.parse(mode)
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    check_tensor("k", k, ndim=3, dtypes=(q.dtype,), last_dim_contiguous=True)
    num_tokens, num_q_heads, rotary_dim = q.shape
    check_shape("k", k, (num_tokens, -1, rotary_dim))
    check_tensor("positions", positions, ndim=1, dtypes=(torch.int32, torch.int64),
                 contiguous=True)
    check_shape("positions", positions, (num_tokens,))
    check_tensor(
        "cos_sin_cache", cos_sin_cache, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True
    )
    check_shape("cos_sin_cache", cos_sin_cache, (-1, rotary_dim))
    if rotary_dim % 2:
        raise ValueError(f"q: rotary dim must be even, got {rotary_dim}")
    if not isinstance(is_neox, bool):
        raise ValueError(f"is_neox: expected a bool, got {is_neox!r}")
    check_same_device(q=q, k=k, positions=positions, cos_sin_cache=cos_sin_cache)

    num_k_heads = k.shape[1]
    q_out = q if inplace else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = k if inplace else torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    cfg = config or rope_config(num_tokens, num_q_heads, num_k_heads, rotary_dim, q.dtype, mode)
    n_q_tiles = cdiv(num_q_heads, cfg.BLOCK_H)
    grid = (cdiv(num_tokens, cfg.BLOCK_T), n_q_tiles + cdiv(num_k_heads, cfg.BLOCK_H))
    _rope_kernel[grid](
        q,
        k,
        q_out,
        k_out,
        positions,
        cos_sin_cache,
        num_tokens,
        num_q_heads,
        num_k_heads,
        rotary_dim // 2,
        n_q_tiles,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        cos_sin_cache.stride(0),
        IS_NEOX=is_neox,
        BLOCK_T=cfg.BLOCK_T,
        BLOCK_H=cfg.BLOCK_H,
        BLOCK_D=cfg.BLOCK_D,
        num_warps=cfg.num_warps,
    )
    return q_out, k_out


# ----------------------------------------------------------------------------------------------
# cos/sin cache (plain torch, built once per model)
# ----------------------------------------------------------------------------------------------


def _rope_params(scaling: dict | None) -> dict:
    """Normalise HF v4 ``rope_scaling`` (``type`` or ``rope_type``) and v5 ``rope_parameters``."""
    if not scaling:
        return {}
    params = dict(scaling)
    kind = params.get("rope_type", params.get("type", "default"))
    params["rope_type"] = kind
    return params


def _yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_scale(scaling: dict | None) -> float:
    """Softmax-scale multiplier of YaRN models: mscale(factor, mscale_all_dim)^2, else 1.0.

    This is DeepSeek-V3's ``yarn_apply_mscale`` in transformers (applied when the rope type is not
    default and ``mscale_all_dim`` is set); multiply ``head_dim ** -0.5`` by it.
    """
    params = _rope_params(scaling)
    if params.get("rope_type", "default") == "default":
        return 1.0
    mscale_all_dim = params.get("mscale_all_dim") or 0
    if not mscale_all_dim:
        return 1.0
    m = _yarn_get_mscale(float(params["factor"]), float(mscale_all_dim))
    return m * m


def _yarn_inv_freq(rotary_dim: int, base: float, params: dict) -> tuple[torch.Tensor, float]:
    """(inv_freq [R/2] fp32, attention_factor) exactly as transformers' _compute_yarn_parameters."""
    try:
        factor = float(params["factor"])
        original_max = int(params["original_max_position_embeddings"])
    except KeyError as missing:
        raise ValueError(f"scaling: yarn needs {missing.args[0]!r}") from None
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = _yarn_get_mscale(factor, mscale) / _yarn_get_mscale(
                factor, mscale_all_dim
            )
        else:
            attention_factor = _yarn_get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (rotary_dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (
            2 * math.log(base)
        )

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # as HF: avoid a zero-width ramp
    ramp = torch.clamp(
        (torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1
    )
    extrapolation_factor = 1 - ramp
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_factor) + (
        1.0 / pos_freqs
    ) * extrapolation_factor
    return inv_freq, float(attention_factor)


def rope_inv_freq(
    rotary_dim: int, base: float, scaling: dict | None = None
) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim / 2] fp32, attention_factor) for plain RoPE or YaRN, as transformers'
    rope init functions return them (``rope_theta`` inside ``scaling`` overrides ``base``)."""
    params = _rope_params(scaling)
    base = float(params.get("rope_theta", base))
    if not base > 0:
        raise ValueError(f"base: expected a positive float, got {base!r}")
    kind = params.get("rope_type", "default")
    if kind == "default":
        inv_freq = 1.0 / (
            base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
        )
        return inv_freq, 1.0
    if kind == "yarn":
        return _yarn_inv_freq(rotary_dim, base, params)
    raise ValueError(f"scaling: rope_type {kind!r} not supported (default, yarn)")


def build_rope_cache(
    rotary_dim: int,
    max_position: int,
    base: float,
    scaling: dict | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The [max_position, rotary_dim] cache: cos of the R/2 angles, then their sin.

    ``scaling`` accepts HF ``rope_scaling`` dicts (``"type"`` or ``"rope_type"``) and v5
    ``rope_parameters`` dicts (``rope_theta`` inside overrides ``base``). ``default`` is plain RoPE;
    ``yarn`` follows ``_compute_yarn_parameters`` with its attention factor folded into cos and sin.
    Angles are position * inv_freq in fp32, as transformers computes them.
    """
    if not isinstance(rotary_dim, int) or rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim: expected a positive even int, got {rotary_dim!r}")
    if not isinstance(max_position, int) or max_position <= 0:
        raise ValueError(f"max_position: expected a positive int, got {max_position!r}")
    inv_freq, attention_factor = rope_inv_freq(rotary_dim, base, scaling)
    angles = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cache = torch.cat([angles.cos() * attention_factor, angles.sin() * attention_factor], dim=-1)
    return cache.to(dtype=dtype, device=device)
