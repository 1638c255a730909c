"""Token embedding and the LM head (logits in float32).

Embedding is a row gather (bitwise the same in every mode). The LM head is a linear over the
rows it is given: through ``models.ops.linear`` when the caller passes its OpsConfig (batch
invariance then follows the mode), otherwise a plain matmul (position-invariant at a fixed N).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models import ops
from models.forward_batch import OpsConfig


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, hidden: torch.Tensor, ops_config: OpsConfig | None = None) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] float32 (computed in the weight dtype, then widened)."""
        hidden = hidden.to(self.weight.dtype)
        if ops_config is None:
            logits = F.linear(hidden, self.weight)
        else:
            logits = ops.linear(hidden, self.weight, ops_config)
        return logits.float()
