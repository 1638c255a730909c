"""Token sampling with request-bound noise, and per-token log-probabilities.

``sample(logits [B, V], temperature, top_k, top_p, seeds, sample_indices, positions) -> [B] int64``
draws by Gumbel-max, argmax(logits / T - log(-log u)) over the row's top-k/top-p set, with ``u``
from Philox4x32-10 keyed by the request seed and counted by (vocab index, position, sample index, 0)
(``sampling_uniform_reference``, bit for bit). Temperature 0 is greedy argmax (lowest id on ties).

Top-k and top-p need no sort. Scaled logits map to int keys that order like the floats (the fp32
bit pattern, negative values flipped), and each threshold is found by bisection on that key:
- top-k keeps ``key >= t_k`` with t_k the largest key whose count ``key >= t_k`` is >= k (the k-th
  largest value; ties at it are all kept, where the reference keeps the lowest ids);
- top-p keeps ``key >= t_p`` with t_p the smallest key whose mass strictly above it (softmax over
  the top-k set) is < top_p: the reference's "smallest set whose mass reaches top_p, the crossing
  token kept", tie-free. The mass is summed in fp32 block order, so a row whose mass crosses top_p
  within rounding of a token may differ from the fp64 reference there.
Bisection stops once the kept *set* is pinned (no token key between the bounds, or exactly k kept).

Invariance: one program owns one row and sweeps the vocab in fixed blocks; the config reads only V
and the dtype; the noise is a function of the row's own (seed, position, sample index). A row's
token (and log-probability) depends only on its own inputs under every mode: batch- and
position-invariant in ``default``, ``batch_invariant`` and ``corun``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.mode import Mode
from kernels.utils import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_same_device,
    check_shape,
    check_tensor,
    next_power_of_2,
)


@triton.jit
def _philox_uniform(offs, position, sample_index, seed):
    """u in (0, 1) for vocab indices ``offs``: Philox4x32-10 word 0, top 24 bits, centred."""
    seed = seed.to(tl.uint64)
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    c0 = offs.to(tl.uint32)
    zeros = tl.zeros_like(c0)
    c1 = zeros + position.to(tl.uint32)
    c2 = zeros + sample_index.to(tl.uint32)
    c3 = zeros
    for _ in tl.static_range(10):
        hi0 = tl.umulhi(c0, 0xD2511F53)
        lo0 = c0 * 0xD2511F53
        hi1 = tl.umulhi(c2, 0xCD9E8D57)
        lo1 = c2 * 0xCD9E8D57
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return ((c0 >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)


@triton.jit
def _sample_kernel(
    # pointers
    logits_ptr,
    temperature_ptr,
    top_k_ptr,
    top_p_ptr,
    seeds_ptr,
    sample_indices_ptr,
    positions_ptr,
    out_ptr,
    # sizes
    vocab,
    # strides
    stride_logits_b,
    # meta
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_logits_b
    temperature = tl.load(temperature_ptr + row).to(tl.float32)
    is_greedy = temperature == 0.0
    temp = tl.maximum(temperature, 1e-6)
    top_k = tl.load(top_k_ptr + row).to(tl.int64)
    top_p = tl.load(top_p_ptr + row).to(tl.float32)
    offs = tl.arange(0, BLOCK_V)
    temp_block = tl.zeros([BLOCK_V], tl.float32) + temp
    # Every sweep recomputes s = logits / T and its order key inline (fp32 bits with negative
    # patterns flipped below the positives); inlined rather than a helper because each nested
    # jit call costs milliseconds under the interpreter.

    # Sweep 1: the range of keys and the max scaled logit.
    key_min = tl.zeros([], tl.int64) + (1 << 40)
    key_max = tl.zeros([], tl.int64) - (1 << 40)
    s_max = tl.zeros([], tl.float32) + float("-inf")
    for start in range(0, vocab, BLOCK_V):
        cols = start + offs
        mask = cols < vocab
        x = tl.load(row_ptr + cols, mask=mask, other=float("-inf")).to(tl.float32)
        s = tl.math.div_rn(x, temp_block)
        bits = s.to(tl.int32, bitcast=True)
        key = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)
        key_min = tl.minimum(key_min, tl.min(tl.where(mask, key, 1 << 40), axis=0))
        key_max = tl.maximum(key_max, tl.max(tl.where(mask, key, -(1 << 40)), axis=0))
        s_max = tl.maximum(s_max, tl.max(s, axis=0))

    # Top-k: largest t with count(key >= t) >= k. Invariant: count(lo) >= k > count(hi).
    do_top_k = (top_k > 0) & (top_k < vocab) & (temperature != 0.0)
    lo = key_min
    hi = tl.where(do_top_k, key_max + 1, key_min + 1)
    while hi - lo > 1:
        mid = lo + (hi - lo) // 2
        count = tl.zeros([], tl.int64)
        for start in range(0, vocab, BLOCK_V):
            cols = start + offs
            mask = cols < vocab
            x = tl.load(row_ptr + cols, mask=mask, other=float("-inf")).to(tl.float32)
            bits = tl.math.div_rn(x, temp_block).to(tl.int32, bitcast=True)
            key = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)
            count += tl.sum((mask & (key >= mid)).to(tl.int64), axis=0)
        exact = count == top_k  # exactly k kept: the set is pinned, stop
        lo = tl.where(count >= top_k, mid, lo)
        hi = tl.where(exact, mid + 1, tl.where(count >= top_k, hi, mid))
    t_k = lo

    # Top-p over the top-k set: mass normaliser and the counts that bound the search.
    do_top_p = (top_p < 1.0) & (temperature != 0.0)
    z = tl.zeros([], tl.float32)
    n_kept = tl.zeros([], tl.int64)
    n_at_max = tl.zeros([], tl.int64)
    for start in range(0, tl.where(do_top_p, vocab, 0), BLOCK_V):
        cols = start + offs
        mask = cols < vocab
        x = tl.load(row_ptr + cols, mask=mask, other=float("-inf")).to(tl.float32)
        s = tl.math.div_rn(x, temp_block)
        bits = s.to(tl.int32, bitcast=True)
        key = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)
        in_k = mask & (key >= t_k)
        z += tl.sum(tl.where(in_k, tl.exp(s - s_max), 0.0), axis=0)
        n_kept += tl.sum(in_k.to(tl.int64), axis=0)
        n_at_max += tl.sum((mask & (key >= key_max)).to(tl.int64), axis=0)
    # Smallest t with mass(key > t) < top_p * z. Invariants: mass(lo) >= target > mass(hi);
    # n_above_lo = count(key > lo), n_from_hi = count(key >= hi); equal counts = no token between.
    target = top_p * z
    lo = t_k - 1
    hi = tl.where(do_top_p, key_max, t_k)
    n_above_lo = n_kept
    n_from_hi = n_at_max
    while (hi - lo > 1) & (n_above_lo != n_from_hi):
        mid = lo + (hi - lo) // 2
        mass = tl.zeros([], tl.float32)
        n_above = tl.zeros([], tl.int64)
        n_from = tl.zeros([], tl.int64)
        for start in range(0, vocab, BLOCK_V):
            cols = start + offs
            mask = cols < vocab
            x = tl.load(row_ptr + cols, mask=mask, other=float("-inf")).to(tl.float32)
            s = tl.math.div_rn(x, temp_block)
            bits = s.to(tl.int32, bitcast=True)
            key = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)
            in_k = mask & (key >= t_k)
            mass += tl.sum(tl.where(in_k & (key > mid), tl.exp(s - s_max), 0.0), axis=0)
            n_above += tl.sum((in_k & (key > mid)).to(tl.int64), axis=0)
            n_from += tl.sum((in_k & (key >= mid)).to(tl.int64), axis=0)
        below = mass < target
        hi = tl.where(below, mid, hi)
        n_from_hi = tl.where(below, n_from, n_from_hi)
        lo = tl.where(below, lo, mid)
        n_above_lo = tl.where(below, n_above_lo, n_above)
    threshold = hi

    # Final sweep: Gumbel-max over the kept set (or plain argmax when greedy), lowest id on ties.
    seed = tl.load(seeds_ptr + row)
    position = tl.load(positions_ptr + row)
    sample_index = tl.load(sample_indices_ptr + row)
    best_val = tl.zeros([], tl.float32) + float("-inf")
    best_idx = tl.zeros([], tl.int64)
    for start in range(0, vocab, BLOCK_V):
        cols = start + offs
        mask = cols < vocab
        x = tl.load(row_ptr + cols, mask=mask, other=float("-inf")).to(tl.float32)
        s = tl.math.div_rn(x, temp_block)
        bits = s.to(tl.int32, bitcast=True)
        key = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)
        u = _philox_uniform(cols, position, sample_index, seed)
        noisy = tl.where(key >= threshold, s - tl.log(-tl.log(u)), float("-inf"))
        val = tl.where(mask, tl.where(is_greedy, x, noisy), float("-inf"))
        block_val, block_idx = tl.max(
            val, axis=0, return_indices=True, return_indices_tie_break_left=True
        )
        better = block_val > best_val  # strict: an earlier block wins a tie
        best_idx = tl.where(better, start + block_idx.to(tl.int64), best_idx)
        best_val = tl.where(better, block_val, best_val)
    tl.store(out_ptr + row, best_idx)


@triton.jit
def _uniform_kernel(
    # pointers
    seeds_ptr,
    sample_indices_ptr,
    positions_ptr,
    out_ptr,
    # sizes
    vocab,
    # meta
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    u = _philox_uniform(
        cols,
        tl.load(positions_ptr + row),
        tl.load(sample_indices_ptr + row),
        tl.load(seeds_ptr + row),
    )
    tl.store(out_ptr + row * vocab + cols, u, mask=cols < vocab)


@triton.jit
def _token_logprobs_kernel(
    # pointers
    logits_ptr,
    token_ids_ptr,
    out_ptr,
    # sizes
    vocab,
    # strides
    stride_logits_b,
    # meta
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_logits_b
    offs = tl.arange(0, BLOCK_V)
    # Online logsumexp in fp32, blocks in vocab order (a fixed order for a fixed V).
    m = tl.zeros([], tl.float32) + float("-inf")
    total = tl.zeros([], tl.float32)
    for start in range(0, vocab, BLOCK_V):
        cols = start + offs
        x = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        new_m = tl.maximum(m, tl.max(x, axis=0))
        alpha = tl.where(m == new_m, 1.0, tl.exp(m - new_m))  # m = new_m = -inf: keep 0, no NaN
        total = total * alpha + tl.sum(tl.where(x == float("-inf"), 0.0, tl.exp(x - new_m)), axis=0)
        m = new_m
    token = tl.load(token_ids_ptr + row).to(tl.int64)
    valid = (token >= 0) & (token < vocab)  # an out-of-range id gives NaN, never a wild read
    x_token = tl.load(row_ptr + token, mask=valid, other=float("nan")).to(tl.float32)
    tl.store(out_ptr + row, x_token - (m + tl.log(total)))


@dataclass(frozen=True)
class SamplingConfig:
    """Vocab block swept per step and warps per row."""

    BLOCK_V: int
    num_warps: int


def sampling_config(vocab_size: int, dtype: torch.dtype, mode: Mode = Mode.CORUN) -> SamplingConfig:
    """Pure policy of V only (never the batch size); the same for every mode, since the row kernel
    is batch-invariant as it stands."""
    del dtype, mode
    block = min(next_power_of_2(vocab_size), 4096)
    return SamplingConfig(BLOCK_V=block, num_warps=4 if block <= 1024 else 8)


def _check_logits(logits: object) -> tuple[int, int]:
    """[B, V] float logits with a non-empty vocab; returns (B, V)."""
    check_tensor("logits", logits, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    batch, vocab = logits.shape
    if vocab == 0:
        raise ValueError("logits: expected a non-empty vocab dim")
    return batch, vocab


def _check_per_row(name: str, t: object, batch: int, dtypes: tuple[torch.dtype, ...]) -> None:
    check_tensor(name, t, ndim=1, dtypes=dtypes)
    check_shape(name, t, (batch,))


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    sample_indices: torch.Tensor,
    positions: torch.Tensor,
    *,
    mode: Mode = Mode.CORUN,
) -> torch.Tensor:
    """Sampled token ids [B] int64; ``sample_reference``'s draws (module docstring for ties).

    temperature [B] f32 (0 = greedy), top_k [B] int (<= 0 or >= V: off), top_p [B] f32 (1: off),
    seeds [B] int64, sample_indices [B] int, positions [B] int. Batch- and position-invariant under
    every mode. Values are not range-checked (that would synchronise the device).
    """
    mode = Mode.parse(mode)
    batch, vocab = _check_logits(logits)
    _check_per_row("temperature", temperature, batch, (torch.float32,))
    _check_per_row("top_k", top_k, batch, INDEX_DTYPES)
    _check_per_row("top_p", top_p, batch, (torch.float32,))
    _check_per_row("seeds", seeds, batch, (torch.int64,))
    _check_per_row("sample_indices", sample_indices, batch, INDEX_DTYPES)
    _check_per_row("positions", positions, batch, INDEX_DTYPES)
    check_same_device(
        logits=logits,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seeds=seeds,
        sample_indices=sample_indices,
        positions=positions,
    )
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if batch == 0:
        return out
    cfg = sampling_config(vocab, logits.dtype, mode)
    _sample_kernel[(batch,)](
        logits,
        temperature,
        top_k,
        top_p,
        seeds,
        sample_indices,
        positions,
        out,
        vocab,
        logits.stride(0),
        BLOCK_V=cfg.BLOCK_V,
        num_warps=cfg.num_warps,
    )
    return out


def sampling_uniform(
    seeds: torch.Tensor, sample_indices: torch.Tensor, positions: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """The noise ``sample`` draws with, [B, V] fp32: ``sampling_uniform_reference`` bit for bit."""
    check_tensor("seeds", seeds, ndim=1, dtypes=(torch.int64,))
    batch = seeds.shape[0]
    _check_per_row("sample_indices", sample_indices, batch, INDEX_DTYPES)
    _check_per_row("positions", positions, batch, INDEX_DTYPES)
    check_same_device(seeds=seeds, sample_indices=sample_indices, positions=positions)
    if not isinstance(vocab_size, int) or vocab_size <= 0:
        raise ValueError(f"vocab_size: expected a positive int, got {vocab_size!r}")
    out = torch.empty((batch, vocab_size), dtype=torch.float32, device=seeds.device)
    if batch == 0:
        return out
    cfg = sampling_config(vocab_size, torch.float32)
    _uniform_kernel[(batch, triton.cdiv(vocab_size, cfg.BLOCK_V))](
        seeds,
        sample_indices,
        positions,
        out,
        vocab_size,
        BLOCK_V=cfg.BLOCK_V,
        num_warps=cfg.num_warps,
    )
    return out


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, *, mode: Mode = Mode.CORUN
) -> torch.Tensor:
    """log_softmax(logits[b])[token_ids[b]] in fp32, [B]; an id outside [0, V) gives NaN.

    Batch- and position-invariant under every mode (one program per row, fixed block order).
    """
    mode = Mode.parse(mode)
    batch, vocab = _check_logits(logits)
    _check_per_row("token_ids", token_ids, batch, INDEX_DTYPES)
    check_same_device(logits=logits, token_ids=token_ids)
    out = torch.empty(batch, dtype=torch.float32, device=logits.device)
    if batch == 0:
        return out
    cfg = sampling_config(vocab, logits.dtype, mode)
    _token_logprobs_kernel[(batch,)](
        logits,
        token_ids,
        out,
        vocab,
        logits.stride(0),
        BLOCK_V=cfg.BLOCK_V,
        num_warps=cfg.num_warps,
    )
    return out
