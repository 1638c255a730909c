"""Token embedding and the LM head (logits in float32), vocab-parallel under tensor parallelism.

Each rank holds ``ceil(V / W)`` vocabulary rows starting at ``rank * ceil(V / W)`` (the last
shard zero-padded when W does not divide V, as vLLM pads).

- Embedding: a row gather of the ids this rank holds, zeros for the others, then the all-reduce.
  Exactly one rank contributes a non-zero row per token, so the sum is the TP=1 row bit for bit
  (``x + 0 = x``) under every reduce policy.
- LM head: a linear over the rows it is given (through ``models.ops.linear`` when the caller
  passes its OpsConfig, so batch invariance follows the mode; otherwise a plain matmul,
  position-invariant at a fixed N), then the ranks' vocab slices are gathered in rank order
  into full-vocabulary logits on every rank (a gather does no arithmetic).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models import ops
from models.forward_batch import OpsConfig
from models.parallel import SINGLE, ParallelContext
from models.weights import ShardLayout


class _VocabShard(nn.Module):
    """The weight [ceil(V / W), H] of this rank's vocabulary rows [vocab_start, vocab_end)."""

    def __init__(self, vocab_size: int, hidden_size: int, parallel: ParallelContext) -> None:
        super().__init__()
        self.vocab_size, self.hidden_size, self.parallel = vocab_size, hidden_size, parallel
        per_rank = -(-vocab_size // parallel.world_size)
        self.vocab_start = min(parallel.rank * per_rank, vocab_size)
        self.vocab_end = min(self.vocab_start + per_rank, vocab_size)
        self.weight = nn.Parameter(torch.empty(per_rank, hidden_size), requires_grad=False)

    def shard_layout(self, leaf: str) -> ShardLayout:
        rows = self.vocab_end - self.vocab_start
        return ShardLayout((self.vocab_size, self.hidden_size),
                           (((slice(0, rows),), (slice(self.vocab_start, self.vocab_end),)),))


class VocabEmbedding(_VocabShard):
    def __init__(self, vocab_size: int, hidden_size: int,
                 parallel: ParallelContext = SINGLE) -> None:
        super().__init__(vocab_size, hidden_size, parallel)

    def forward(self, input_ids: torch.Tensor, ops_config: OpsConfig | None = None
                ) -> torch.Tensor:
        if not self.parallel.is_parallel:
            return F.embedding(input_ids, self.weight)
        if ops_config is None:
            raise ValueError("ops_config: required by a tensor-parallel embedding")
        is_local = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(is_local, input_ids - self.vocab_start, 0)
        rows = F.embedding(local_ids, self.weight).masked_fill(~is_local.unsqueeze(-1), 0.0)
        return self.parallel.all_reduce(rows, ops_config.mode)


class LMHead(_VocabShard):
    def __init__(self, vocab_size: int, hidden_size: int,
                 parallel: ParallelContext = SINGLE) -> None:
        super().__init__(vocab_size, hidden_size, parallel)

    def forward(self, hidden: torch.Tensor, ops_config: OpsConfig | None = None) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] float32 (computed in the weight dtype, then widened)."""
        hidden = hidden.to(self.weight.dtype)
        if ops_config is None:
            logits = F.linear(hidden, self.weight)
        else:
            logits = ops.linear(hidden, self.weight, ops_config)
        if self.parallel.is_parallel:
            logits = self.parallel.all_gather(logits, dim=-1)[:, : self.vocab_size]
        return logits.float()
