"""The paged cache writes, each a Triton kernel and its launcher: ``store_kv`` fills the K/V caches
that prefill and decode attention read (with the cache checks attention shares), ``store_mla_kv``
the MLA latent cache that ``kernels.mla`` reads.

Layouts: K/V caches [num_blocks, block_size, num_kv_heads, head_dim], block_size a power of 2
>= 8; the MLA cache [num_blocks, block_size, latent_dim + rope_dim]. A token's flat slot is
block * block_size + offset; slot -1 (a padded token) is skipped. Each write is a copy, so its
bits are the input's in every mode (references: ``kernels.reference.store_kv_reference``,
``store_mla_kv_reference``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.utils import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_same_device,
    check_shape,
    check_tensor,
    is_host_checkable,
    next_power_of_2,
)


@triton.jit
def _store_kv_kernel(
    # pointers
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    # sizes
    head_dim, block_size,
    # strides
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_co, stride_ch,
    # constexprs
    BLOCK_D: tl.constexpr,
):
    """One program per (token, kv head): copy one head row of k and v into its cache slot."""
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + pid_t).to(tl.int64)
    if slot < 0:  # padded decode slot: nothing to write
        return
    block = slot // block_size
    offset = slot % block_size
    offs_d = tl.arange(0, BLOCK_D)
    mask = offs_d < head_dim
    k = tl.load(k_ptr + pid_t * stride_kt + pid_h * stride_kh + offs_d, mask=mask)
    v = tl.load(v_ptr + pid_t * stride_vt + pid_h * stride_vh + offs_d, mask=mask)
    dst = block * stride_cb + offset * stride_co + pid_h * stride_ch + offs_d
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


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
    """One program per token: copy its latent and k_pe rows into one row of its cache slot."""
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


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def check_slots(slot_mapping: torch.Tensor, num_slots: int) -> None:
    """Every flat slot in [-1, num_slots) (-1: skip), where the slots can be read without a
    device sync (``is_host_checkable``)."""
    if is_host_checkable(slot_mapping) and slot_mapping.numel():
        low, high = int(slot_mapping.min()), int(slot_mapping.max())
        if high >= num_slots or low < -1:
            raise ValueError(f"slot_mapping: slots must lie in [-1, {num_slots}) (-1: skip), "
                             f"got [{low}, {high}]")


def check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor, dtype: torch.dtype) -> None:
    check_tensor("k_cache", k_cache, ndim=4, dtypes=(dtype,), last_dim_contiguous=True)
    check_tensor("v_cache", v_cache, ndim=4, dtypes=(dtype,), last_dim_contiguous=True)
    check_shape("v_cache", v_cache, k_cache.shape)
    if v_cache.stride() != k_cache.stride():
        # The kernels address both caches with one set of strides.
        raise ValueError(f"v_cache: expected the strides of k_cache {k_cache.stride()}, "
                         f"got {v_cache.stride()}")
    if not is_pow2(k_cache.shape[1]) or k_cache.shape[1] < 8:
        raise ValueError(f"k_cache: block_size must be a power of 2 >= 8, got {k_cache.shape[1]}")


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write k, v [T, Hkv, D] into the paged caches at flat slots (block * block_size + offset).

    Slot -1 skips the token (padded decode slots). A pure copy: bitwise, in every mode.
    """
    check_tensor("k", k, ndim=3, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    check_tensor("v", v, ndim=3, dtypes=(k.dtype,), last_dim_contiguous=True)
    check_shape("v", v, k.shape)
    check_caches(k_cache, v_cache, k.dtype)
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=INDEX_DTYPES, contiguous=True)
    check_shape("slot_mapping", slot_mapping, (k.shape[0],))
    check_shape("k", k, (-1, k_cache.shape[2], k_cache.shape[3]))
    check_same_device(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    check_slots(slot_mapping, k_cache.shape[0] * k_cache.shape[1])
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens, num_kv_heads)](
        k, v, k_cache, v_cache, slot_mapping,
        head_dim, k_cache.shape[1],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_D=next_power_of_2(head_dim),
    )


def store_mla_kv(
    latent: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write ``[latent | k_pe]`` ([T, Lkv], [T, R]) at flat slots of the MLA cache
    [NB, BS, Lkv + R].

    Slot ``-1`` (a padded token) is skipped. A copy: exact and invariant in every mode.
    """
    check_tensor("latent", latent, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    check_tensor("k_pe", k_pe, ndim=2, dtypes=(latent.dtype,), last_dim_contiguous=True)
    check_tensor("kv_cache", kv_cache, ndim=3, dtypes=(latent.dtype,), last_dim_contiguous=True)
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=INDEX_DTYPES, contiguous=True)
    check_same_device(latent=latent, k_pe=k_pe, kv_cache=kv_cache, slot_mapping=slot_mapping)
    num_tokens, latent_dim = latent.shape
    rope_dim = k_pe.shape[1]
    check_shape("k_pe", k_pe, (num_tokens, -1))
    check_shape("kv_cache", kv_cache, (-1, -1, latent_dim + rope_dim))
    check_shape("slot_mapping", slot_mapping, (num_tokens,))
    num_blocks, block_size, _ = kv_cache.shape
    check_slots(slot_mapping, num_blocks * block_size)
    if num_tokens == 0:
        return
    _store_mla_kv_kernel[(num_tokens,)](
        latent, k_pe, kv_cache, slot_mapping,
        latent_dim, rope_dim, block_size,
        latent.stride(0), k_pe.stride(0), kv_cache.stride(0), kv_cache.stride(1),
        BLOCK_L=next_power_of_2(latent_dim), BLOCK_R=next_power_of_2(rope_dim),
    )  # fmt: skip
