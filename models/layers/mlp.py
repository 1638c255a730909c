"""The SwiGLU MLP: ``down(silu(gate(x)) * up(x))`` with gate and up fused into one GEMM."""

from __future__ import annotations

import torch
from torch import nn

from models import ops
from models.forward_batch import OpsConfig
from models.layers.linear import Linear, MergedLinear


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size, intermediate_size])
        self.down_proj = Linear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor, ops_config: OpsConfig) -> torch.Tensor:
        hidden = ops.silu_mul(self.gate_up_proj(x, ops_config), ops_config)
        return self.down_proj(hidden, ops_config)
