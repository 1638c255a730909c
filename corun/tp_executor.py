"""Tensor-parallel execution: the engine's process is rank 0, ranks 1..N-1 are worker processes.

Topology (vLLM's "driver worker"): the engine's process is rank 0. It keeps the one scheduler,
holds rank 0's model shard and KV-cache shard, runs its shard like every other rank, and samples
from the full-vocabulary logits (the model gathers them on every rank). Ranks 1..N-1 are
persistent worker processes (``spawn``: CUDA needs it, and it is safe beside the server's
threads), each with its ``ModelRunner`` over its own shard; on CUDA rank r uses GPU r and NCCL,
on the CPU every rank is a process and the group is gloo.

One step (``TPModelRunner.run``):

1. rank 0 checks that every worker is alive (exit codes, error reports on the pipes);
2. it sends a small ``StepHeader`` through each worker's pipe. The pipe is the wake-up: an idle
   worker blocks on it, never inside a collective, so an idle server cannot hit a collective
   timeout;
3. it broadcasts the step's filled static buffer (``corun.step_inputs``: input ids, positions,
   slots, block tables, lengths, token mask, sample rows and sampling parameters, one byte
   tensor) from rank 0 into every worker's own buffer of the same layout, so every rank binds
   the same views to the same ``ForwardBatch`` over its own cache shard;
4. every rank runs the same step (the shape's graph, or the eager forward): the row-parallel
   layers all-reduce by ``models.parallel.reduce_policy(mode, N)`` and the logits are gathered
   to the full vocabulary; rank 0 reads the samples, the workers drop theirs.

Swap-out / swap-in / drop go through the same pipes, in order with the steps, so every rank
copies its own cache shard to and from host memory. Each rank captures its own CUDA graphs at the
same buckets, in the same order (the captures run the collectives together). The KV block count
is agreed at start-up (``ModelRunner._agree_num_blocks``: the smallest rank's count).

Determinism: the tensors each rank sees at a step are exactly the TP=1 engine's, so corun's
shapes still depend only on the request (isolated prefill) or are fixed (decode at ``B``); the
collectives follow ``reduce_policy`` unchanged (plain all-reduce under corun at 2 ranks, where
``a + b`` has one result; rank-order sum under batch_invariant and under corun past 2 ranks).

Failure: a worker that raises reports its traceback through its pipe and exits; one that dies
closes its sockets, so rank 0's pending gloo collective fails at once, and between steps its exit
code is seen. Either way rank 0 raises ``WorkerError`` naming the rank, kills the other workers
and refuses further steps. Every collective has the ``distributed_timeout_s`` limit (with NCCL a
death in the middle of a collective is bounded by it). A worker whose driver dies sees its pipe
close and exits.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from corun import memory_plan
from corun.config import EngineConfig
from corun.model_runner import ModelRunner, StepResult, check_model_len
from corun.step import StepPart, StepShape
from corun.step_inputs import StepBuffers, StepHost
from models.parallel import ParallelContext, WorkerError, find_free_port

# How long failure reports are collected after a failure is first seen: a killed worker makes
# its peers fail too, and the dead one is the cause to name.
_SETTLE_S = 0.5


@dataclass(frozen=True)
class StepHeader:
    """What a worker needs besides the step's buffer: its shape and host ints. The buffer (the
    runner's static step buffer, filled by rank 0) follows as one broadcast."""

    shape: StepShape
    host: StepHost


# ---------------------------------------------------------------------------------------------
# worker side (ranks 1..N-1)
# ---------------------------------------------------------------------------------------------


def _init_process_group(config: EngineConfig, rank: int, port: int) -> None:
    if config.is_cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group(config.distributed_backend, init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=config.tensor_parallel_size,
                            timeout=timedelta(seconds=config.distributed_timeout_s))


def _serve_steps(runner: ModelRunner, conn: Any) -> None:
    """Run the driver's commands until "shutdown"; EOFError if the driver is gone."""
    while True:
        command, *args = conn.recv()
        if command == "step":
            header: StepHeader = args[0]
            runner.receive_and_launch(header)
        elif command == "swap_out":
            runner.swap_out(*args)
        elif command == "swap_in":
            runner.swap_in(*args)
        elif command == "drop_swapped":
            runner.drop_swapped(*args)
        elif command == "update_weights":
            runner.update_weights(*args)
        elif command == "update_weights_broadcast":
            _receive_weights(runner, *args)
        elif command == "weights_digest":
            _gather_digest(runner.parallel, ModelRunner.weights_digest(runner))
        elif command == "shutdown":
            return
        else:
            raise RuntimeError(f"unknown tensor-parallel command {command!r}")


def _receive_weights(runner: ModelRunner, specs: list[tuple[str, tuple, torch.dtype]]) -> None:
    """A worker's side of a named-tensor update: each tensor broadcast by rank 0 in ``specs``
    order, its slices copied as it arrives (one full tensor alive at a time)."""
    _apply_broadcast(runner, specs, lambda key, shape, dtype: _broadcast_from_rank0(
        runner, torch.empty(shape, dtype=dtype, device=runner.device)))


def _broadcast_from_rank0(runner: ModelRunner, tensor: torch.Tensor) -> torch.Tensor:
    dist.broadcast(tensor, src=0, group=runner.parallel.group)
    return tensor


def _apply_broadcast(runner: ModelRunner, specs: list[tuple[str, tuple, torch.dtype]],
                     fetch: Any) -> None:
    """Plan the update from the specs (names, shapes, dtypes), then fetch and copy tensor by
    tensor; every rank runs this in the same order."""
    from models.loader import copy_tensors, plan_tensors

    shapes = {key: torch.empty(shape, dtype=dtype, device="meta") for key, shape, dtype in specs}
    plan = plan_tensors(runner.model, runner.model_config, shapes)
    for key, shape, dtype in specs:
        if key in plan:
            copy_tensors(runner.model, {key: plan[key]}, {key: fetch(key, shape, dtype)})
    runner.model.process_weights_after_loading()


def _gather_digest(parallel: ParallelContext, own: str) -> str:
    """Every rank's weights digest, in rank order, hashed into one (rank 0's result)."""
    import hashlib

    digests: list[str | None] = [None] * parallel.world_size
    dist.all_gather_object(digests, own, group=parallel.group)
    return hashlib.sha256("|".join(digests).encode()).hexdigest()


def _worker_main(config: EngineConfig, rank: int, port: int, conn: Any) -> None:
    try:
        if not config.is_cuda:
            # The CPU's cores are shared by all ranks (2 ranks on 2 cores: one thread each).
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.tensor_parallel_size))
        _init_process_group(config, rank, port)
        runner = ModelRunner(config, parallel=ParallelContext.from_process_group())
        conn.send(("ready", runner.num_kv_blocks))
        _serve_steps(runner, conn)
        runner.destroy()
        dist.destroy_process_group()
    except EOFError:
        os._exit(0)  # the driver is gone: nobody to report to, peers are being torn down
    except BaseException:  # noqa: BLE001 - reported to the driver, which raises WorkerError
        try:
            conn.send(("error", traceback.format_exc()))
        finally:
            os._exit(1)  # skip teardown that could block on peers stuck in a collective


# ---------------------------------------------------------------------------------------------
# driver side (rank 0)
# ---------------------------------------------------------------------------------------------


class WorkerGroup:
    """Ranks 1..N-1 as processes, and rank 0's own process group; see the module docstring."""

    def __init__(self, config: EngineConfig) -> None:
        if dist.is_initialized():
            raise ValueError("tensor_parallel_size: torch.distributed is already initialised "
                             "in this process; the engine creates its own process group")
        if config.is_cuda and torch.cuda.device_count() < config.tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size: {config.tensor_parallel_size} ranks need "
                             f"as many GPUs, {torch.cuda.device_count()} visible")
        self.config = config
        if config.is_cuda:
            torch.cuda.set_device(0)  # rank 0's GPU, for this (the engine's) thread
        ctx = mp.get_context("spawn")
        port = find_free_port()
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self._reports: dict[int, str] = {}
        try:
            for rank in range(1, config.tensor_parallel_size):
                parent_conn, child_conn = ctx.Pipe()
                proc = ctx.Process(target=_worker_main, args=(config, rank, port, child_conn),
                                   name=f"corun-tp-rank{rank}", daemon=True)
                proc.start()
                child_conn.close()  # only the child holds its end: its death closes the pipe
                self.procs.append(proc)
                self.conns.append(parent_conn)
        except BaseException:  # the workers already started must not outlive the failure
            self.stop(grace_s=0.0)
            raise
        try:
            self._join_group(port)
        except BaseException:
            self.stop(grace_s=0.0)
            raise

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self.procs]

    def _join_group(self, port: int) -> None:
        """Rank 0 joins the group; a worker that dies meanwhile raises at once, not after the
        rendezvous timeout (the join runs in a thread while this one watches the workers)."""
        errors: list[BaseException] = []

        def join() -> None:
            try:
                _init_process_group(self.config, 0, port)
            except BaseException as exc:  # noqa: BLE001 - re-raised by the watching thread
                errors.append(exc)

        thread = threading.Thread(target=join, name="corun-tp-init", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.05)
            self.check()
        if errors:
            raise WorkerError(f"tensor-parallel group did not form: {errors[0]!r}")

    def wait_ready(self, num_kv_blocks: int) -> None:
        """Every worker built its shard (and agreed on ``num_kv_blocks``)."""
        deadline = time.monotonic() + self.config.distributed_timeout_s
        for rank, conn in enumerate(self.conns, start=1):
            while not conn.poll(0.05):
                self.check()
                if time.monotonic() > deadline:
                    raise WorkerError(f"tensor-parallel rank {rank} not ready after "
                                      f"{self.config.distributed_timeout_s} s")
            try:
                message = conn.recv()
            except EOFError:
                message = ("exited",)
            if message[0] == "error":
                self._reports[rank] = message[1]
            if message[0] != "ready":
                self.check()
                raise WorkerError(self.failure() or f"tensor-parallel rank {rank}: {message!r}")
            if message != ("ready", num_kv_blocks):
                raise WorkerError(f"tensor-parallel rank {rank}: expected ready with "
                                  f"{num_kv_blocks} KV blocks, got {message!r}")

    def _collect(self) -> None:
        for rank, conn in enumerate(self.conns, start=1):
            try:
                while rank not in self._reports and conn.poll():
                    kind, *payload = conn.recv()
                    if kind == "error":
                        self._reports[rank] = payload[0]
            except (EOFError, OSError):
                pass  # closed by a dead worker: its exit code tells

    def failure(self) -> str | None:
        """What went wrong with the workers, or None: silent deaths first (they are the cause of
        their peers' failures), then reported tracebacks."""
        self._collect()
        silent = [f"tensor-parallel rank {rank} exited with code {proc.exitcode}"
                  for rank, proc in enumerate(self.procs, start=1)
                  if proc.exitcode is not None and rank not in self._reports]
        raised = [f"tensor-parallel rank {rank} failed:\n{trace}"
                  for rank, trace in sorted(self._reports.items())]
        return "\n".join(silent + raised) or None

    def check(self) -> None:
        """Raise WorkerError if a worker died or reported an error (cheap: run every step)."""
        if any(proc.exitcode is not None for proc in self.procs) or any(
                conn.poll() for conn in self.conns):
            deadline = time.monotonic() + _SETTLE_S
            message = self.failure()
            while message is None and time.monotonic() < deadline:
                time.sleep(0.02)
                message = self.failure()
            if message is not None:
                raise WorkerError(message)

    def send(self, *command: Any) -> None:
        for conn in self.conns:
            conn.send(command)

    def stop(self, grace_s: float = 5.0) -> None:
        """Ask the workers to exit, wait up to ``grace_s``, kill the rest (these processes only,
        by handle), then leave rank 0's process group."""
        if grace_s > 0:
            try:
                self.send("shutdown")
            except (BrokenPipeError, OSError):
                grace_s = 0.0
        deadline = time.monotonic() + grace_s
        for proc in self.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5.0)
        for conn in self.conns:
            conn.close()
        self.conns = []
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken group may fail to tear down; it is gone
                pass


class TPModelRunner(ModelRunner):
    """Rank 0's ModelRunner: every call that touches the model or the KV cache is first sent to
    the workers, so all ranks run the same step on their shards."""

    def __init__(self, config: EngineConfig) -> None:
        if not config.is_parallel:
            raise ValueError(f"tensor_parallel_size: TPModelRunner needs > 1, got "
                             f"{config.tensor_parallel_size}")
        check_model_len(config, memory_plan.model_config_of(config.model))  # before any worker
        self._failure: str | None = None
        self.workers = WorkerGroup(config)
        with self._guard():
            super().__init__(config, parallel=ParallelContext.from_process_group())
            self.workers.wait_ready(self.num_kv_blocks)

    @contextmanager
    def _guard(self) -> Iterator[None]:
        """Any failure leaves the ranks out of step: stop every worker, and raise WorkerError
        naming the failed rank when one did (else the rank-0 error itself)."""
        if self._failure is not None:
            raise WorkerError(f"the tensor-parallel group is stopped: {self._failure}")
        try:
            yield
        except BaseException as exc:
            deadline = time.monotonic() + _SETTLE_S
            message = self.workers.failure()
            while message is None and time.monotonic() < deadline and not isinstance(
                    exc, (ValueError, KeyboardInterrupt)):
                time.sleep(0.02)
                message = self.workers.failure()
            self._failure = message or f"rank 0 failed: {exc!r}"
            self.workers.stop(grace_s=0.0)
            if message is not None:
                raise WorkerError(message) from exc
            raise

    def _publish(self, shape: StepShape, bufs: StepBuffers, host: StepHost) -> None:
        self.workers.check()
        self.workers.send("step", StepHeader(shape, host))
        dist.broadcast(bufs.dev, src=0, group=self.parallel.group)

    def execute(self, part: StepPart) -> StepResult:
        with self._guard():
            return super().execute(part)

    def check_health(self) -> None:
        with self._guard():
            self.workers.check()

    def swap_out(self, seq_id: int, blocks: list[int]) -> None:
        with self._guard():
            self.workers.send("swap_out", seq_id, list(blocks))
            super().swap_out(seq_id, blocks)

    def swap_in(self, seq_id: int, block_table: list[int]) -> None:
        with self._guard():
            self.workers.send("swap_in", seq_id, list(block_table))
            super().swap_in(seq_id, block_table)

    def drop_swapped(self, seq_id: int) -> None:
        if self._failure is None:
            with self._guard():
                self.workers.send("drop_swapped", seq_id)
        super().drop_swapped(seq_id)

    def weights_digest(self) -> str:
        """The digest of every rank's shard (gathered in rank order)."""
        with self._guard():
            self.workers.send("weights_digest")
            return _gather_digest(self.parallel, super().weights_digest())

    def update_weights(self, weights: Any) -> None:
        """Every rank loads its shard: a checkpoint directory from disk, named tensors
        broadcast from here one at a time. Validated on rank 0 before any worker is told (a bad
        update leaves every rank's weights and the group as they were)."""
        from models.loader import check_checkpoint, plan_tensors

        if isinstance(weights, (str, os.PathLike)):
            check_checkpoint(self.model, self.model_config, weights)
            with self._guard():
                self.workers.send("update_weights", str(weights))
                super().update_weights(weights)
            return
        weights = dict(weights)
        plan_tensors(self.model, self.model_config, weights)
        specs = [(key, tuple(t.shape), t.dtype) for key, t in weights.items()]
        with self._guard():
            self.workers.send("update_weights_broadcast", specs)
            _apply_broadcast(self, specs, lambda key, shape, dtype: _broadcast_from_rank0(
                self, weights[key].to(self.device).contiguous()))

    def destroy(self) -> None:
        """Graphs first, then the workers, then rank 0's process group (idempotent); the
        workers stop even if rank 0's teardown raises."""
        try:
            super().destroy()
        finally:
            self.workers.stop(grace_s=0.0 if self._failure is not None else 5.0)
            self._failure = self._failure or "the engine was shut down"
