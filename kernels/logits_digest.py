"""Exact integer digest of fp32 logits rows: the device half of ``corun/fingerprint.py``.

``logits_digest(logits fp32 [N, V]) -> int64 [N, 2]``: with ``b_v`` the int32 bit pattern of
logit ``v`` widened (sign-extended) to int64, ``d1 = sum_v b_v * (2v + 1)`` and
``d2 = sum_v b_v * h(v)``, ``h(v) = (v * golden + 1) | 1``, every product and sum wrapping mod
2**64: ``logits_digest_reference`` bit for bit.

One pass over the row: each program digests a fixed piece of BLOCK_V columns of one row and adds
its two partial sums into the row's output with an integer atomic add. Integer addition mod 2**64
is associative and commutative, so the result does not depend on the split, the order in which
the programs finish, the batch or the slot: a row's digest is a function of its own bits under
every launch configuration.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.utils import cdiv, check_tensor, next_power_of_2

# The golden-ratio multiplier of h(v), as the signed int64 with the same bits as 0x9E3779B97F4A7C15.
GOLDEN_INT64 = 0x9E3779B97F4A7C15 - (1 << 64)


@triton.jit
def _logits_digest_kernel(
    # pointers
    logits_ptr,
    out_ptr,
    # sizes
    vocab,
    # strides
    stride_logits_n,
    # meta
    GOLDEN: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < vocab
    x = tl.load(logits_ptr + row * stride_logits_n + cols, mask=mask, other=0.0)
    bits = x.to(tl.int32, bitcast=True).to(tl.int64)  # sign-extends, as torch's .to(int64)
    weight_1 = 2 * cols + 1
    weight_2 = (cols * GOLDEN + 1) | 1
    # Masked columns load 0.0 (bits 0), so they add nothing; int64 products and sums wrap.
    d1 = tl.sum(bits * weight_1, axis=0)
    d2 = tl.sum(bits * weight_2, axis=0)
    tl.atomic_add(out_ptr + row * 2, d1)
    tl.atomic_add(out_ptr + row * 2 + 1, d2)


@dataclass(frozen=True)
class LogitsDigestConfig:
    """Columns per program and its warps (any value gives the same digest)."""

    BLOCK_V: int
    num_warps: int


@functools.lru_cache(maxsize=64)
def logits_digest_config(vocab_size: int) -> LogitsDigestConfig:
    """Pure policy of V: pieces of up to 8192 columns (19 programs a row at V = 151936), so a
    single row still spreads over many SMs."""
    block = min(next_power_of_2(vocab_size), 8192)
    return LogitsDigestConfig(BLOCK_V=block, num_warps=4 if block <= 2048 else 8)


def logits_digest(
    logits: torch.Tensor, *, config: LogitsDigestConfig | None = None
) -> torch.Tensor:
    """The [N, 2] int64 digest of fp32 ``logits`` [N, V] (module docstring), on its device.

    The last dim must be contiguous; rows may be strided. ``config`` overrides the policy (tests:
    any split gives the same digest). Graph capturable (a zero fill and one launch, sizes from the
    shape only).
    """
    check_tensor("logits", logits, ndim=2, dtypes=(torch.float32,), last_dim_contiguous=True)
    num_rows, vocab = logits.shape
    out = torch.zeros((num_rows, 2), dtype=torch.int64, device=logits.device)
    if num_rows == 0 or vocab == 0:
        return out
    cfg = config or logits_digest_config(vocab)
    _logits_digest_kernel[(num_rows, cdiv(vocab, cfg.BLOCK_V))](
        logits,
        out,
        vocab,
        logits.stride(0),
        GOLDEN=GOLDEN_INT64,
        BLOCK_V=cfg.BLOCK_V,
        num_warps=cfg.num_warps,
    )
    return out
