"""Rotary position embedding: the cos/sin table (plain RoPE or YaRN) and the module applying it.

The table is ``[max_position, R]`` with the cos half then the sin half (the layout of
``kernels.rope``), computed in fp32 exactly as transformers v5 ``_compute_default_rope_parameters``
/ ``_compute_yarn_parameters`` do, so HF parity holds to fp32 rounding; YaRN's cos/sin attention
factor is folded in. Qwen3 rotates NeoX halves; DeepSeek-V3 rotates interleaved pairs
(``is_neox=False``). Per token: position- and batch-invariant in every mode.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from models import ops
from models.forward_batch import OpsConfig


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_softmax_scale_factor(scaling: dict[str, Any] | None) -> float:
    """The MLA softmax-scale multiplier mscale(factor, mscale_all_dim)^2 (1.0 without YaRN)."""
    if not scaling or scaling.get("rope_type") != "yarn" or not scaling.get("mscale_all_dim"):
        return 1.0
    return yarn_get_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2


def _yarn_inv_freq(dim: int, base: float, scaling: dict[str, Any],
                   max_position: int) -> tuple[torch.Tensor, float]:
    original_max = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position / original_max
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = (yarn_get_mscale(factor, mscale)
                                / yarn_get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = yarn_get_mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(original_max / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF: avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1 - ramp
    inv_freq = ((1.0 / (factor * pos_freqs)) * (1 - extrapolation)
                + (1.0 / pos_freqs) * extrapolation)
    return inv_freq, float(attention_factor)


def build_cos_sin_cache(rotary_dim: int, max_position: int, base: float,
                        scaling: dict[str, Any] | None = None,
                        device: torch.device | str | None = None) -> torch.Tensor:
    """``[max_position, rotary_dim]`` fp32: cos(pos * inv_freq) | sin(pos * inv_freq)."""
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "yarn":
        inv_freq, attention_factor = _yarn_inv_freq(rotary_dim, base, scaling, max_position)
    elif rope_type == "default":
        exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
        inv_freq, attention_factor = 1.0 / (base ** exponent), 1.0
    else:
        raise ValueError(f"rope_scaling: unsupported rope_type {rope_type!r} (default, yarn)")
    positions = torch.arange(max_position, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]
    cache = torch.cat([freqs.cos() * attention_factor, freqs.sin() * attention_factor], dim=-1)
    return cache.to(device)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q [T, Hq, R] and k [T, Hk, R] at ``positions``; holds the fp32 table."""

    def __init__(self, rotary_dim: int, max_position: int, base: float,
                 scaling: dict[str, Any] | None, is_neox: bool) -> None:
        super().__init__()
        self.rotary_dim, self.max_position, self.base = rotary_dim, max_position, base
        self.scaling, self.is_neox = scaling, is_neox
        # Not in the state dict: derived from the config, rebuilt on the target device.
        self.register_buffer("cos_sin_cache", torch.empty(max_position, rotary_dim),
                             persistent=False)

    def init_buffers(self) -> None:
        """(Re)compute the table in fp32 on this module's device (after meta construction)."""
        device = self.cos_sin_cache.device
        self.cos_sin_cache = build_cos_sin_cache(self.rotary_dim, self.max_position, self.base,
                                                 self.scaling, device=device)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                ops_config: OpsConfig) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.rope(q, k, positions, self.cos_sin_cache, self.is_neox, ops_config)
