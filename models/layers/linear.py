"""Linear layers, replicated or tensor-parallel, in nn.Linear layout (weight [out, in]).

- ``Linear``: the full weight on every rank (routers, MLA's q_a / kv_a projections).
- ``ColumnParallelLinear``: the output dim split across ranks, no communication. It may stack
  several HF linears over one input along the output dim (fused q|k|v, gate|up): each stacked
  output is split on its own (``local_ranges``), so every rank holds its part of q, of k and of v.
  ``shard_rows(i)`` is where HF module i's rows sit in the full (TP=1) weight; the loader uses it
  with a model's ``packed_modules_mapping``.
- ``RowParallelLinear``: the input dim split, a partial product per rank, then the all-reduce of
  ``ParallelContext.all_reduce`` (its policy follows the step's mode) unless the caller reduces
  several partial sums at once (``reduce_results=False``).

Bit-level behaviour of the GEMM is ``models.ops.linear``'s (batch-invariant only under
batch_invariant); at TP=1 these layers compute exactly a plain linear.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from models import ops
from models.forward_batch import OpsConfig
from models.parallel import SINGLE, ParallelContext
from models.weights import ShardLayout


class Linear(nn.Module):
    """``y = x @ W.T (+ b)``, weight [out_features, in_features], replicated on every rank."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features), requires_grad=False)
                     if bias else None)

    def forward(self, x: torch.Tensor, ops_config: OpsConfig) -> torch.Tensor:
        return ops.linear(x, self.weight, ops_config, self.bias)


class ColumnParallelLinear(Linear):
    """Stacked outputs ``output_sizes`` (full sizes), each split across ranks.

    ``local_ranges[i]`` = [start, stop) of stacked output i that this rank holds; by default its
    equal share (ValueError if uneven). GQA passes head-aligned ranges for k and v, which repeat
    on several ranks when there are fewer kv heads than ranks.
    """

    def __init__(self, in_features: int, output_sizes: Sequence[int],
                 parallel: ParallelContext = SINGLE, bias: bool = False,
                 local_ranges: Sequence[tuple[int, int]] | None = None) -> None:
        if local_ranges is None:
            local_ranges = [parallel.shard(size, "output_sizes") for size in output_sizes]
        if len(local_ranges) != len(output_sizes):
            raise ValueError(f"local_ranges: expected {len(output_sizes)} ranges, "
                             f"got {len(local_ranges)}")
        super().__init__(in_features, sum(stop - start for start, stop in local_ranges), bias)
        self.parallel = parallel
        self.output_sizes = list(output_sizes)
        self.local_ranges = [tuple(r) for r in local_ranges]

    def shard_rows(self, shard: int) -> slice:
        """The full-weight rows of stacked output ``shard`` (HF module ``shard``)."""
        start = sum(self.output_sizes[:shard])
        return slice(start, start + self.output_sizes[shard])

    def shard_layout(self, leaf: str) -> ShardLayout:
        pieces, local = [], 0
        for shard, (start, stop) in enumerate(self.local_ranges):
            offset = self.shard_rows(shard).start
            pieces.append(((slice(local, local + stop - start),),
                           (slice(offset + start, offset + stop),)))
            local += stop - start
        full = (sum(self.output_sizes), self.in_features)
        return ShardLayout(full if leaf == "weight" else full[:1], tuple(pieces))


class RowParallelLinear(Linear):
    """Input dim split across ranks; ``x`` is this rank's [M, in/W] slice (the output of a
    column-parallel layer). Returns the reduced [M, out], or the partial sum with
    ``reduce_results=False``. A bias (every rank holds all of it) is added once, after the
    reduction."""

    def __init__(self, in_features: int, out_features: int,
                 parallel: ParallelContext = SINGLE, reduce_results: bool = True,
                 bias: bool = False) -> None:
        if bias and not reduce_results:
            raise ValueError("bias: a row-parallel bias is added after the reduction, so it "
                             "needs reduce_results")
        self.in_range = parallel.shard(in_features, "in_features")
        super().__init__(self.in_range[1] - self.in_range[0], out_features, bias)
        self.parallel, self.reduce_results = parallel, reduce_results
        self.full_in_features = in_features

    def shard_layout(self, leaf: str) -> ShardLayout | None:
        if leaf != "weight":
            return None  # the bias: replicated
        start, stop = self.in_range
        return ShardLayout((self.out_features, self.full_in_features),
                           (((slice(None), slice(0, stop - start)),
                             (slice(None), slice(start, stop))),))

    def forward(self, x: torch.Tensor, ops_config: OpsConfig) -> torch.Tensor:
        partial = ops.linear(x, self.weight, ops_config)
        if not self.reduce_results:
            return partial
        out = self.parallel.all_reduce(partial, ops_config.mode)
        return out if self.bias is None else out + self.bias
