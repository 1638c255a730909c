"""The SwiGLU MLP: ``down(silu(gate(x)) * up(x))`` with gate and up fused into one GEMM.

Tensor parallel: gate|up column-parallel (each rank its slice of the intermediate, on which
silu * up is element-wise), down row-parallel with the all-reduce, or without it when the caller
sums this partial with another before one reduction (DeepSeek-V3's shared experts).
"""

from __future__ import annotations

import torch
from torch import nn

from models import ops
from models.forward_batch import OpsConfig
from models.layers.linear import ColumnParallelLinear, RowParallelLinear
from models.parallel import SINGLE, ParallelContext


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int,
                 parallel: ParallelContext = SINGLE, reduce_results: bool = True) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden_size,
                                                 [intermediate_size, intermediate_size], parallel)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, parallel,
                                           reduce_results)

    def forward(self, x: torch.Tensor, ops_config: OpsConfig) -> torch.Tensor:
        hidden = ops.silu_mul(self.gate_up_proj(x, ops_config), ops_config)
        return self.down_proj(hidden, ops_config)
