"""RMSNorm as in Qwen3 / DeepSeek-V3: fp32 statistics, cast back, then times the weight.

With a residual it returns ``(norm(x + residual), x + residual)`` so the decoder layers carry the
residual stream without an extra pass. Row-wise: position- and batch-invariant in every mode.
"""

from __future__ import annotations

import torch
from torch import nn

from models import ops
from models.forward_batch import OpsConfig


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, ops_config: OpsConfig,
                residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return ops.rmsnorm(x, self.weight, self.eps, ops_config, residual)
