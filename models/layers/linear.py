"""Linear layers: plain and output-stacked (fused q|k|v, gate|up) weights in nn.Linear layout.

A ``MergedLinear`` holds several HF linears stacked along the output dim; ``shard_rows(i)`` is
where HF module i's rows live, which the loader uses with a model's ``packed_modules_mapping``.
Bit-level behaviour is ``models.ops.linear``'s (batch-invariant only under batch_invariant).
"""

from __future__ import annotations

import torch
from torch import nn

from models import ops
from models.forward_batch import OpsConfig


class Linear(nn.Module):
    """``y = x @ W.T (+ b)``, weight [out_features, in_features]."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features), requires_grad=False)
                     if bias else None)

    def forward(self, x: torch.Tensor, ops_config: OpsConfig) -> torch.Tensor:
        return ops.linear(x, self.weight, ops_config, self.bias)


class MergedLinear(Linear):
    """Several linears over one input stacked along the output dim (one GEMM instead of many)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__(in_features, sum(output_sizes), bias)
        self.output_sizes = list(output_sizes)

    def shard_rows(self, shard: int) -> slice:
        """The weight rows of stacked module ``shard``."""
        start = sum(self.output_sizes[:shard])
        return slice(start, start + self.output_sizes[shard])
