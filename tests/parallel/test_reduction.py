"""The tensor-parallel reductions on 4 gloo CPU ranks, bitwise.

Every rank runs the same derandomized hypothesis examples (no shrinking, so the ranks' collective
calls stay in step); a failing assertion on any rank fails the parent through ``spawn_workers``.
Each rank's tensor comes from one ``torch.Generator`` seeded by the drawn seed, which draws all
the ranks' tensors in rank order, so every rank can compute the expected sum by itself.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kernels.mode import Mode
from models.parallel import (
    ParallelContext,
    ReducePolicy,
    all_reduce_rank_order,
    reduce_policy,
    spawn_workers,
)

WORLD = 4
# Same examples on every rank: no database, no shrinking, no time-based health checks.
IN_STEP = settings(max_examples=12, derandomize=True, database=None, deadline=None,
                   phases=(Phase.explicit, Phase.generate),
                   suppress_health_check=list(HealthCheck))


def rank_inputs(seed: int, rows: int, cols: int, world: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, cols, generator=gen) for _ in range(world)]


def rank_order_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    acc = parts[0].float().clone()  # fp32 accumulation, as the reduction documents
    for part in parts[1:]:
        acc = acc + part.float()
    return acc


def plain_all_reduce(x: torch.Tensor, group=None) -> torch.Tensor:
    x = x.clone()
    dist.all_reduce(x, group=group)
    return x


def _reductions(parallel: ParallelContext) -> dict:
    rank = parallel.rank
    pair = dist.new_group([0, 1])  # every rank must create it

    @IN_STEP
    @given(rows=st.integers(1, 40), cols=st.integers(1, 24), seed=st.integers(0, 2**63 - 1))
    def rank_order_equals_sum_in_rank_order(rows, cols, seed):
        """The batch_invariant reduction is bitwise the fp32 sum of the ranks' parts in rank
        order."""
        parts = rank_inputs(seed, rows, cols, WORLD)
        out = all_reduce_rank_order(parts[rank], WORLD)
        assert torch.equal(out, rank_order_sum(parts))
        assert torch.equal(parallel.all_reduce(parts[rank], Mode.BATCH_INVARIANT), out)

    @IN_STEP
    @given(rows=st.integers(1, 40), other_rows=st.integers(1, 40), row=st.integers(0, 39),
           slot=st.integers(0, 39), seed=st.integers(0, 2**63 - 1),
           other_seed=st.integers(0, 2**63 - 1))
    def rank_order_is_batch_invariant(rows, other_rows, row, slot, seed, other_seed):
        """A row's reduced bits do not depend on the batch size, its row index or the other
        rows."""
        row, slot = row % rows, slot % other_rows
        parts = rank_inputs(seed, rows, 8, WORLD)
        other = rank_inputs(other_seed, other_rows, 8, WORLD)[rank]
        other[slot] = parts[rank][row]  # the same row, elsewhere in another batch
        a = all_reduce_rank_order(parts[rank], WORLD)[row]
        b = all_reduce_rank_order(other, WORLD)[slot]
        assert torch.equal(a, b)

    @IN_STEP
    @given(rows=st.integers(1, 40), cols=st.integers(1, 24), seed=st.integers(0, 2**63 - 1))
    def two_rank_all_reduce_is_rank_order(rows, cols, seed):
        """At 2 ranks the backend's all_reduce is bitwise the rank-order sum (corun's policy)."""
        parts = rank_inputs(seed, rows, cols, 2)
        if rank < 2:
            assert torch.equal(plain_all_reduce(parts[rank], pair), rank_order_sum(parts))

    rank_order_equals_sum_in_rank_order()
    rank_order_is_batch_invariant()
    two_rank_all_reduce_is_rank_order()

    # Negative controls: at 4 ranks the backend's all_reduce (a ring) is neither the rank-order
    # sum nor position-invariant, so the checks above can fail (64 elements, as measured).
    parts = rank_inputs(7, 16, 4, WORLD)
    plain = plain_all_reduce(parts[rank])
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(5))
    permuted = plain_all_reduce(parts[rank][perm])
    return {"differs_from_rank_order": int((plain != rank_order_sum(parts)).sum()),
            "differs_when_permuted": int((permuted != plain[perm]).sum())}


def test_reductions_on_four_ranks():
    results = spawn_workers(_reductions, WORLD, start_method="fork", num_threads=1,
                            timeout_s=120)
    for result in results:
        assert result["differs_from_rank_order"] > 0
        assert result["differs_when_permuted"] > 0
    assert all(result == results[0] for result in results)  # every rank got the same sums


def test_reduce_policy_by_mode():
    """default: the backend's collective; batch_invariant: rank order; corun: the collective
    only at 2 ranks, where every order gives the same bits."""
    assert reduce_policy(Mode.DEFAULT, 8) == ReducePolicy.ALL_REDUCE
    assert reduce_policy(Mode.BATCH_INVARIANT, 2) == ReducePolicy.RANK_ORDER
    assert reduce_policy(Mode.CORUN, 2) == ReducePolicy.ALL_REDUCE
    assert reduce_policy(Mode.CORUN, 4) == ReducePolicy.RANK_ORDER
