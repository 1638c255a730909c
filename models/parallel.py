"""Tensor parallelism: the parallel context the layers hold, its collectives, and worker spawning.

``ParallelContext`` (rank, world size, process group) is passed to a model at construction and
held by the layers that shard or communicate; there is no module-global group (vLLM's
``get_tp_group()``). At ``world_size == 1`` every collective is the identity, so the TP=1 code
path computes exactly what it computed before tensor parallelism existed.

Which all-reduce a step uses is ``reduce_policy(mode, world_size)``, one pure function:

- ``ALL_REDUCE``: the backend's collective (NCCL / gloo). At a fixed shape its reduction order
  is fixed, but it may depend on an element's *index*: ring algorithms cut the buffer into chunks
  and start each chunk's sum at another rank. Measured with gloo on 4 CPU ranks: permuting the
  rows of a 64-element all_reduce changes 12 of the 64 results, and a shorter buffer changes 7 of
  the first 35 (tests/parallel/test_reduction.py). So it is neither batch- nor
  position-invariant past 2 ranks. At 2 ranks every algorithm computes ``a + b`` or ``b + a``,
  bitwise the same (IEEE addition is commutative), so it is both.
- ``RANK_ORDER``: all_gather, then sum the ranks' parts in rank order in fp32 (fp64 for fp64)
  and cast back. Element-wise with one order: row i depends on row i of each rank only, whatever
  the batch, the row index or the other rows. Costs world_size x the buffer in traffic and memory.

``default`` takes ``ALL_REDUCE``; ``batch_invariant`` takes ``RANK_ORDER`` (its collectives change
size with the batch); ``corun`` takes ``ALL_REDUCE`` at 2 ranks and ``RANK_ORDER`` past 2: its
shapes depend only on the request (isolated prefill) or are fixed (decode at B), but a decode
request's slot is its row index, and the ring order would make its bits depend on that slot.

``spawn_workers(fn, world_size)`` starts one process per rank with an initialised process group,
returns each rank's result, and turns a failure in any rank (exception, crash, timeout) into a
``WorkerError`` in the parent within a poll interval, killing the other ranks.
"""

from __future__ import annotations

import enum
import io
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from kernels.mode import Mode


class ReducePolicy(enum.Enum):
    ALL_REDUCE = "all_reduce"  # the backend's collective
    RANK_ORDER = "rank_order"  # all_gather, then sum in rank order in fp32


def reduce_policy(mode: Mode, world_size: int) -> ReducePolicy:
    """The all-reduce of a mode. May read only the mode and the world size (module docstring)."""
    if mode == Mode.DEFAULT:
        return ReducePolicy.ALL_REDUCE
    if mode == Mode.CORUN and world_size <= 2:
        return ReducePolicy.ALL_REDUCE  # two operands: every order gives the same bits
    return ReducePolicy.RANK_ORDER


def even_shard(size: int, rank: int, world_size: int, what: str) -> tuple[int, int]:
    """[start, stop) of rank's equal part of ``size``; ValueError naming ``what`` if uneven."""
    if size % world_size:
        raise ValueError(f"{what}: {size} is not divisible by the tensor-parallel size "
                         f"{world_size}")
    part = size // world_size
    return rank * part, (rank + 1) * part


@dataclass(frozen=True)
class ParallelContext:
    """Which tensor-parallel rank this model instance is, and the group it reduces over.

    ``group`` is a ``torch.distributed`` process group, or None for the default group (and for
    TP=1, which never communicates). Models are built with it (``build_model(..., parallel=)``)
    and each sharded layer keeps it; weights can be built and loaded without a process group,
    only the forward pass of a TP>1 model communicates.
    """

    rank: int = 0
    world_size: int = 1
    group: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size: expected >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank: expected 0..{self.world_size - 1}, got {self.rank}")

    @classmethod
    def from_process_group(cls, group: Any = None) -> ParallelContext:
        """The context of this process in ``group`` (None: the default group)."""
        return cls(dist.get_rank(group), dist.get_world_size(group), group)

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    def shard(self, size: int, what: str) -> tuple[int, int]:
        """[start, stop) of this rank's equal part of ``size`` (ValueError naming ``what``)."""
        return even_shard(size, self.rank, self.world_size, what)

    def all_reduce(self, x: torch.Tensor, mode: Mode) -> torch.Tensor:
        """Sum of ``x`` over the ranks by ``reduce_policy(mode, world_size)``; ``x`` itself at
        TP=1. May reuse ``x``'s storage (the layers pass fresh GEMM outputs)."""
        if self.world_size == 1:
            return x
        if reduce_policy(mode, self.world_size) == ReducePolicy.ALL_REDUCE:
            x = x.contiguous()
            dist.all_reduce(x, group=self.group)
            return x
        return all_reduce_rank_order(x, self.world_size, self.group)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' ``x`` concatenated along ``dim`` in rank order (no arithmetic: exact)."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)


SINGLE = ParallelContext()  # TP=1: immutable, never communicates


def all_reduce_rank_order(x: torch.Tensor, world_size: int, group: Any = None) -> torch.Tensor:
    """``sum_r x_r`` added in rank order 0, 1, ... in fp32 (fp64 for fp64), cast to x.dtype.

    Element-wise with one order for every element: batch- and position-invariant (row i depends
    on row i of each rank only), unlike a ring all_reduce.
    """
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(parts, x, group=group)
    acc_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    acc = parts[0].to(acc_dtype, copy=True)
    for part in parts[1:]:
        acc += part.to(acc_dtype)
    return acc.to(x.dtype)


# ---------------------------------------------------------------------------------------------
# worker processes
# ---------------------------------------------------------------------------------------------


class WorkerError(RuntimeError):
    """A tensor-parallel worker raised, died or timed out; the message names the rank and why."""


def find_free_port() -> int:
    """A loopback TCP port free right now (the rendezvous of ``init_method='tcp://...'``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serialize(obj: Any) -> bytes:
    # Bytes, not tensors: a tensor sent through a multiprocessing queue would be shared memory
    # owned by a process that is about to exit.
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _worker_main(fn: Callable[..., Any], rank: int, world_size: int, port: int, backend: str,
                 args: tuple, results: Any, num_threads: int | None, timeout_s: float) -> None:
    try:
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))
        out = fn(ParallelContext(rank, world_size, dist.group.WORLD), *args)
        payload = _serialize(out)
        # Every rank is done before any tears down (rank 0 hosts the rendezvous store).
        dist.barrier()
        dist.destroy_process_group()
        results.put((rank, True, payload))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        results.put((rank, False, traceback.format_exc()))
        results.close()
        results.join_thread()
        os._exit(1)  # skip teardown that could block on peers stuck in a collective


def spawn_workers(fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (), *,
                  backend: str = "gloo", timeout_s: float = 60.0, start_method: str = "spawn",
                  num_threads: int | None = None) -> list[Any]:
    """Run ``fn(ParallelContext, *args)`` on ``world_size`` ranks; the results in rank order.

    Each rank is a process with a ``torch.distributed`` group on a fresh loopback port (gloo on
    CPUs, nccl with one GPU per rank). ``fn`` and ``args`` must be picklable under ``spawn``
    (module-level functions); results travel back with ``torch.save``. If any rank raises, exits
    without a result or the whole run exceeds ``timeout_s``, the other ranks are killed and
    ``WorkerError`` carries the failing rank's traceback: a dead worker never hangs the parent.
    ``start_method="fork"`` starts faster on CPUs (tests); CUDA needs ``spawn``.
    """
    if world_size < 1:
        raise ValueError(f"world_size: expected >= 1, got {world_size}")
    ctx = mp.get_context(start_method)
    results = ctx.Queue()
    port = find_free_port()
    procs = [ctx.Process(target=_worker_main, daemon=True, name=f"corun-tp-rank{rank}",
                         args=(fn, rank, world_size, port, backend, tuple(args), results,
                               num_threads, timeout_s))
             for rank in range(world_size)]
    for proc in procs:
        proc.start()
    payloads: dict[int, bytes] = {}
    finished = False
    try:
        deadline = time.monotonic() + timeout_s
        while len(payloads) < world_size:
            try:
                rank, ok, payload = results.get(timeout=0.05)
            except queue.Empty:
                if any(p.exitcode is not None for r, p in enumerate(procs) if r not in payloads):
                    _raise_failures(procs, payloads, results, {})
                if time.monotonic() > deadline:
                    raise WorkerError(f"tensor-parallel workers timed out after {timeout_s} s "
                                      f"({len(payloads)} of {world_size} finished)") from None
                continue
            if not ok:
                _raise_failures(procs, payloads, results, {rank: payload})
            payloads[rank] = payload
        finished = True
    finally:
        # After a failure the other ranks may be blocked in a collective: kill them at once.
        _stop(procs, grace_s=5.0 if finished else 0.0)
    return [torch.load(io.BytesIO(payloads[rank]), weights_only=False)
            for rank in range(world_size)]


def _raise_failures(procs: list[Any], payloads: dict[int, bytes], results: Any,
                    failures: dict[int, str]) -> None:
    """WorkerError naming every rank that failed, if any did. A rank that dies (killed, crashed,
    ``os._exit``) makes its peers fail in their next collective, often before its own exit is
    seen, so reports and exit codes are collected for a short while and the silent deaths are
    named first: they are the cause."""
    settle = time.monotonic() + 0.5
    while time.monotonic() < settle:
        try:
            rank, ok, payload = results.get(timeout=0.05)
        except queue.Empty:
            continue
        if ok:
            payloads[rank] = payload
        else:
            failures[rank] = payload
    silent = [f"tensor-parallel rank {rank} exited with code {proc.exitcode} without a result"
              for rank, proc in enumerate(procs)
              if proc.exitcode not in (None, 0) and rank not in failures and rank not in payloads]
    raised = [f"tensor-parallel rank {rank} failed:\n{trace}"
              for rank, trace in sorted(failures.items())]
    if silent or raised:  # else: the exited rank's result was still in the pipe, now read
        raise WorkerError("\n".join(silent + raised))


def _stop(procs: list[Any], grace_s: float) -> None:
    """Join the ranks for up to ``grace_s``, then kill the ones still running (these processes
    only, by handle)."""
    deadline = time.monotonic() + grace_s
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5.0)
