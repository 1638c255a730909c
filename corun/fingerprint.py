"""Request fingerprints: one hash of a sample's token ids and the bits of the logits behind them.

Two runs of a request are bitwise the same exactly when their fingerprints match (up to sha256
collisions): the hash covers every sampled token id and, at each sampled position, a digest of
the fp32 logits row. Comparing fingerprints therefore catches drift even when greedy tokens happen
to agree.

The per-row digest runs on the device in exact integer arithmetic: with ``b_v`` the int32 bits of
logit ``v`` widened to int64, ``d1 = sum_v b_v * (2v + 1)`` and ``d2 = sum_v b_v * h(v)`` (``h`` a
fixed odd multiplicative hash), both wrapping mod 2**64. Integer addition mod 2**64 is associative,
so the digest does not depend on the reduction order of the sum: it is deterministic itself,
cheap (two integer dot products per row) and moves only 16 bytes per row to the host.
"""

from __future__ import annotations

import hashlib
import struct
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_GOLDEN = 0x9E3779B97F4A7C15


def _as_int64(value: int) -> int:
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


class LogitsDigest:
    """Device-side digest of fp32 logits rows -> [N, 2] int64; weights built once per vocab.

    On CUDA one pass of ``kernels.logits_digest`` (the same integers: exact arithmetic); on the
    CPU the torch form below, which materialises the int64 bits of the whole row."""

    def __init__(self, vocab_size: int, device: torch.device | str) -> None:
        import torch

        v = torch.arange(vocab_size, dtype=torch.int64, device=device)
        # h(v) = (v * golden + 1) | 1, computed with wrapping int64 arithmetic.
        golden = torch.tensor(_as_int64(_GOLDEN), dtype=torch.int64, device=device)
        self.weights = torch.stack([2 * v + 1, (v * golden + 1) | 1], dim=1)  # [V, 2]

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if not logits.is_cuda:
            return self.torch_form(logits)
        from kernels.logits_digest import logits_digest

        self._check(logits)
        return logits_digest(logits)

    @staticmethod
    def _check(logits: torch.Tensor) -> None:
        import torch

        if logits.dtype != torch.float32 or logits.dim() != 2:
            raise ValueError(
                f"logits: expected fp32 [N, V], got {logits.dtype} {tuple(logits.shape)}"
            )

    def torch_form(self, logits: torch.Tensor) -> torch.Tensor:
        """The digest in torch ops on any device (what the CPU runs; on CUDA, what the kernel
        replaced: experiments/bench_align_digest.py times the kernel against it)."""
        import torch

        self._check(logits)
        bits = logits.contiguous().view(torch.int32).to(torch.int64)  # [N, V]
        # Elementwise multiply then integer sum: both wrap mod 2**64 and are order-independent.
        d1 = (bits * self.weights[:, 0]).sum(dim=1)
        d2 = (bits * self.weights[:, 1]).sum(dim=1)
        return torch.stack([d1, d2], dim=1)


class Fingerprint:
    """Incremental sha256 over (token id, d1, d2) per sampled token; ``hexdigest`` at any time."""

    __slots__ = ("_hash", "num_tokens")

    def __init__(self) -> None:
        self._hash = hashlib.sha256(b"corun-fingerprint-v1")
        self.num_tokens = 0

    def update(self, token_id: int, digest: tuple[int, int]) -> None:
        self._hash.update(struct.pack("<qqq", int(token_id), int(digest[0]), int(digest[1])))
        self.num_tokens += 1

    def hexdigest(self) -> str:
        return self._hash.hexdigest()
