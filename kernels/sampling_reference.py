"""Plain-torch reference of the sampling op (``kernels/sampling.py``): request-bound noise from
Philox4x32-10 keyed by the request seed, the top-k / top-p mask, and Gumbel-max sampling.

The noise is the contract the engine's determinism rests on: a row's draw is a function of its
own (seed, sample index, position) only, so the kernel must reproduce these words bit for bit
(``tests/kernels/test_sampling.py``). The other ops' references are in ``kernels/reference.py``.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85
PHILOX_ROUNDS = 10
# The largest fp32 below 1: the sampling noise u stays in (0, 1).
SAMPLING_U_MAX = 1.0 - 2.0**-24


def _mulhilo32(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit halves of a * b for a constant a and uint32 values b held in int64."""
    lo = (b * a) & _MASK32  # the int64 product may wrap; its low 32 bits are still exact
    b_lo, b_hi = b & 0xFFFF, b >> 16
    mid = b_lo * a
    hi = ((b_hi * a) + (mid >> 16)) >> 16
    return hi & _MASK32, lo


def philox_4x32(
    counter: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    key: tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox4x32-10 on uint32 words held in int64 tensors (broadcasting). Returns 4 words."""
    c0, c1, c2, c3 = (c & _MASK32 for c in counter)
    k0, k1 = (k & _MASK32 for k in key)
    for _ in range(PHILOX_ROUNDS):
        hi0, lo0 = _mulhilo32(PHILOX_M0, c0)
        hi1, lo1 = _mulhilo32(PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + PHILOX_W0) & _MASK32
        k1 = (k1 + PHILOX_W1) & _MASK32
    return c0, c1, c2, c3


def sampling_uniform_reference(
    seeds: torch.Tensor, sample_indices: torch.Tensor, positions: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """The request-bound uniform noise u in (0, 1), [B, V] float32.

    Key = the 64-bit request seed (low word, high word); counter = (vocab index, position,
    sample index, 0). Word 0 of the Philox output, top 24 bits, centred: u = (x >> 8 + 0.5) / 2^24,
    at most ``SAMPLING_U_MAX`` (1 - 2^-24, the largest fp32 below 1).
    A row's noise is a function of its own (seed, sample index, position) only.
    """
    seeds = seeds.to(torch.int64).view(-1, 1)
    key = (seeds & _MASK32, (seeds >> 32) & _MASK32)
    vocab = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device).view(1, -1)
    counter = (
        vocab,
        positions.to(torch.int64).view(-1, 1),
        sample_indices.to(torch.int64).view(-1, 1),
        torch.zeros_like(vocab),
    )
    word = philox_4x32(counter, key)[0]
    u = ((word >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    # (2**24 - 1) + 0.5 rounds to 2**24 in fp32: u = 1.0 would give +inf Gumbel noise, so that
    # token would win whatever its probability (one vocab entry in 2**24 per draw).
    return u.clamp_(max=SAMPLING_U_MAX)


def top_k_top_p_mask_reference(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Boolean [B, V] mask of the tokens a row may sample (after temperature scaling).

    ``top_k`` <= 0 disables top-k; ``top_p`` = 1 disables top-p. Top-p keeps the smallest set of
    highest-probability tokens whose mass reaches top_p (the token that crosses it is kept), over
    the top-k survivors, as vLLM and HF apply them (top-k first).
    """
    batch, vocab = logits.shape
    keep = torch.ones_like(logits, dtype=torch.bool)
    for row in range(batch):
        row_logits = logits[row].to(torch.float64)
        order = torch.argsort(row_logits, descending=True, stable=True)
        k = int(top_k[row])
        allowed = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
        n_keep = vocab if k <= 0 else min(k, vocab)
        p = float(top_p[row])
        if p < 1.0:
            probs = torch.softmax(row_logits[order[:n_keep]], dim=0)
            mass_before = torch.cumsum(probs, dim=0) - probs
            n_keep = int((mass_before < p).sum())
        allowed[order[: max(n_keep, 1)]] = True
        keep[row] = allowed
    return keep


def sample_reference(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    sample_indices: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """Sampled token ids [B] (int64). Temperature 0 is greedy (argmax, lowest id on ties).

    Otherwise Gumbel-max over the allowed tokens: argmax(logits / T - log(-log(u))) with ``u`` from
    ``sampling_uniform_reference``, which is an exact draw from softmax(logits / T) restricted to
    the top-k/top-p set.
    """
    scaled = logits.to(torch.float32) / temperature.clamp_min(1e-6).view(-1, 1).to(torch.float32)
    keep = top_k_top_p_mask_reference(scaled, top_k, top_p)
    u = sampling_uniform_reference(seeds, sample_indices, positions, logits.shape[1])
    gumbel = -torch.log(-torch.log(u))
    noisy = torch.where(keep, scaled + gumbel, torch.full_like(scaled, float("-inf")))
    sampled = noisy.argmax(dim=1)
    greedy = logits.argmax(dim=1)
    return torch.where(temperature.view(-1) == 0, greedy, sampled).to(torch.int64)
