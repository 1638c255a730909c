"""Rotary position embedding module: holds the fp32 cos/sin table and applies it via models.ops.

The table is ``kernels.rope.build_rope_cache`` (``[max_position, R]``, cos half then sin half,
plain RoPE or YaRN as transformers computes them, YaRN's cos/sin attention factor folded in), so
the torch and triton backends read the same values. Qwen3 rotates NeoX halves; DeepSeek-V3
rotates interleaved pairs (``is_neox=False``). Per token: position- and batch-invariant in every
mode.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kernels.rope import build_rope_cache, yarn_attention_scale
from models import ops
from models.forward_batch import OpsConfig


def yarn_softmax_scale_factor(scaling: dict[str, Any] | None) -> float:
    """The MLA softmax-scale multiplier mscale(factor, mscale_all_dim)^2 (1.0 without YaRN)."""
    return yarn_attention_scale(scaling)


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
        self.cos_sin_cache = build_rope_cache(self.rotary_dim, self.max_position, self.base,
                                              self.scaling, dtype=torch.float32,
                                              device=self.cos_sin_cache.device)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                ops_config: OpsConfig) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.rope(q, k, positions, self.cos_sin_cache, self.is_neox, ops_config)
