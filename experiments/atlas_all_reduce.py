"""The invariance atlas's all-reduce: the backend's collective and ours in each policy, on every
rank of a process group in lockstep.

A row is one token's hidden vector; each rank holds its own partial of it (drawn from the row's
id and the rank, ``Bank``), as the output of a row-sharded projection does. Each case sums the
partials over the ranks and returns the rows; every rank runs ``check_case`` on the same cases in
the same order, so their collectives stay in step, and rank 0's counts are the records.

- ``vendor``: ``dist.all_reduce`` itself (NCCL on GPUs, gloo on CPU ranks). Ring and tree
  algorithms cut the buffer into chunks and start each chunk at another rank, and NCCL picks its
  algorithm and protocol by message size, so an element's order of addition may follow its index
  and the batch size.
- ours: ``ParallelContext.all_reduce(x, mode)`` in each mode, whose ``reduce_policy`` picks the
  backend's collective (``default``; ``corun`` at 2 ranks, where both orders of two operands give
  the same bits) or the all-gather summed in rank order (``batch_invariant``; ``corun`` past 2).

Where it runs (``all_reduce_records``): one NCCL rank per GPU when at least two GPUs are visible
(up to 8); 4 gloo CPU ranks when there is no GPU (the dry run); a ``skipped`` record on one GPU,
since NCCL will not put two ranks on one device.
"""

from __future__ import annotations

import torch

from experiments.atlas_cases import POLICIES, REAL, TINY, Bank, Case
from kernels.mode import Mode
from models.parallel import ParallelContext, WorkerError, reduce_policy, spawn_workers

CPU_RANKS = 4
MAX_GPU_RANKS = 8
OP = "all_reduce"


def _backend_sum(x: torch.Tensor, parallel: ParallelContext) -> torch.Tensor:
    import torch.distributed as dist

    x = x.contiguous().clone()
    dist.all_reduce(x, group=parallel.group)
    return x


def all_reduce_cases(parallel: ParallelContext, device: torch.device, tiny: bool,
                     backend: str) -> list[Case]:
    """The vendor collective and ``ParallelContext.all_reduce`` in every policy at the atlas's
    hidden size and batch sizes (``REAL`` / ``TINY``)."""
    sizes = TINY if tiny else REAL
    bank = Bank(device, sizes["dtype"])
    hidden, world = sizes["hidden"], parallel.world_size
    shape = f"[M, {hidden}] on {world} ranks"

    def partials(ids: list[int]) -> torch.Tensor:
        return bank.rows(f"all_reduce rank {parallel.rank}", ids, (hidden,))

    cases = [Case(OP, f"{backend} dist.all_reduce", "vendor", shape, sizes["batch"],
                  sizes["sizes"],
                  lambda ids: list(_backend_sum(partials(ids), parallel)))]
    for policy in POLICIES:
        if policy == "batch_invariant_tuned":  # the same reduction as batch_invariant
            continue
        mode = Mode(policy)
        impl = f"ParallelContext.all_reduce ({reduce_policy(mode, world).value})"
        cases.append(Case(OP, impl, policy, shape, sizes["batch"], sizes["sizes"],
                          lambda ids, m=mode: list(parallel.all_reduce(partials(ids).clone(),
                                                                       m))))
    return cases


def _rank_records(parallel: ParallelContext, tiny: bool, backend: str) -> list[dict]:
    from experiments.invariance_atlas import case_record

    device = torch.device("cuda", parallel.rank) if backend == "nccl" else torch.device("cpu")
    records = []
    for case in all_reduce_cases(parallel, device, tiny, backend):
        records.append(case_record(case))
    return records if parallel.rank == 0 else []


def all_reduce_records(native: bool, tiny: bool, timeout_s: float = 120.0) -> list[dict]:
    """The all-reduce cases' records (rank 0's); one ``skipped`` record saying why not, or one
    ``error`` record when the ranks failed (start-up, a collective, ``timeout_s``)."""
    gpus = torch.cuda.device_count() if native else 0
    backend, world = ("nccl", min(gpus, MAX_GPU_RANKS)) if native else ("gloo", CPU_RANKS)
    head = {"op": OP, "impl": f"{backend} dist.all_reduce", "policy": "vendor", "shape": "—"}
    if native and gpus < 2:
        return [{**head, "skipped": f"{gpus} GPU visible: an NCCL all-reduce needs at least 2 "
                                    "(the dry run measures gloo on 4 CPU ranks)"}]
    try:
        per_rank = spawn_workers(_rank_records, world, (tiny, backend), backend=backend,
                                 timeout_s=timeout_s, start_method="spawn" if native else "fork",
                                 num_threads=None if native else 1)
    except WorkerError as exc:  # the atlas's other cases still run
        return [{**head, "world_size": world, "error": str(exc).splitlines()[0][:300]}]
    return [{**r, "world_size": world, "backend": backend} for r in per_rank[0]]
