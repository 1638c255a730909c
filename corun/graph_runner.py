"""GraphRunner: decode steps captured as CUDA graphs at the mode's bucket sizes, then replayed.

Buckets come from the mode (``EngineConfig.decode_buckets``): corun captures exactly one graph at
``B`` (every decode step has that shape); the dynamic modes capture 1, 2, 4, ... and the scheduler
pads each decode step to the next bucket. Graphs are captured largest first into one memory pool
(the smaller ones reuse the largest one's activations), with a ``ForwardBatch`` whose tensors *are*
the static buffers, so replaying is: copy the step's inputs into the buffers, replay, read the
static logits. Dummy slots carry slot -1 and seq_len 0 (``ModelRunner.prepare_decode``), so the
padding writes nothing and reads nothing.

The captured ``max_seq_len`` is ``max_model_len`` in every mode (a graph bakes host ints in); under
corun and batch_invariant that is also what eager decode uses, so eager and replay launch the same
kernels. CPU runs never get here (CUDA graphs need CUDA; the engine runs eagerly).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from models.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from corun.model_runner import ModelRunner


@dataclass
class GraphBuffers:
    """Static decode inputs for the largest bucket; a bucket of size ``n`` uses rows ``:n``."""

    input_ids: torch.Tensor  # [max_bs] int64
    positions: torch.Tensor  # [max_bs] int64
    slot_mapping: torch.Tensor  # [max_bs] int64
    block_tables: torch.Tensor  # [max_bs, width] int32
    seq_lens: torch.Tensor  # [max_bs] int32
    token_mask: torch.Tensor  # [max_bs] bool

    @classmethod
    def allocate(cls, max_bs: int, width: int, device: torch.device) -> GraphBuffers:
        def full(value, *shape, dtype):
            return torch.full(shape, value, dtype=dtype, device=device)

        return cls(input_ids=full(0, max_bs, dtype=torch.int64),
                   positions=full(0, max_bs, dtype=torch.int64),
                   slot_mapping=full(-1, max_bs, dtype=torch.int64),
                   block_tables=full(0, max_bs, width, dtype=torch.int32),
                   seq_lens=full(0, max_bs, dtype=torch.int32),
                   token_mask=full(False, max_bs, dtype=torch.bool))

    def bind(self, size: int, template: ForwardBatch) -> tuple[torch.Tensor, ForwardBatch]:
        """(input_ids, ForwardBatch) views of the first ``size`` rows, for capture."""
        batch = ForwardBatch(
            is_prefill=False, positions=self.positions[:size],
            slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables[:size],
            kv_cache=template.kv_cache, ops=template.ops, seq_lens=self.seq_lens[:size],
            max_seq_len=template.max_seq_len, token_mask=self.token_mask[:size],
        )
        return self.input_ids[:size], batch

    def copy_from(self, input_ids: torch.Tensor, batch: ForwardBatch) -> None:
        """Write one prepared decode step (already padded to its bucket) into the buffers."""
        size = input_ids.shape[0]
        self.input_ids[:size].copy_(input_ids, non_blocking=True)
        self.positions[:size].copy_(batch.positions, non_blocking=True)
        self.slot_mapping[:size].copy_(batch.slot_mapping, non_blocking=True)
        self.block_tables[:size].copy_(batch.block_tables, non_blocking=True)
        self.seq_lens[:size].copy_(batch.seq_lens, non_blocking=True)
        self.token_mask[:size].copy_(batch.token_mask, non_blocking=True)


class GraphRunner:
    """One CUDA graph per decode bucket of a ModelRunner, sharing one memory pool."""

    def __init__(self, runner: ModelRunner, buckets: list[int]) -> None:
        if not torch.cuda.is_available() or runner.device.type != "cuda":
            raise RuntimeError("CUDA graphs need a CUDA device; run eagerly on the CPU")
        self.runner = runner
        self.buckets = sorted(buckets)
        self.buffers = GraphBuffers.allocate(self.buckets[-1], runner.block_width, runner.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None

    @torch.inference_mode()
    def capture(self) -> None:
        runner = self.runner
        template = ForwardBatch(
            is_prefill=False, positions=self.buffers.positions,
            slot_mapping=self.buffers.slot_mapping,
            block_tables=self.buffers.block_tables, kv_cache=runner.kv_cache, ops=runner.ops,
            seq_lens=self.buffers.seq_lens, max_seq_len=runner.config.max_model_len,
            token_mask=self.buffers.token_mask,
        )
        for size in reversed(self.buckets):  # largest first: the rest fit in its pool
            input_ids, batch = self.buffers.bind(size, template)
            # Warm up eagerly first: JIT compilation and lazy allocations must not be captured.
            for _ in range(2):
                runner.model.compute_logits(runner.model(input_ids, batch), runner.ops)
            torch.cuda.synchronize(runner.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                hidden = runner.model(input_ids, batch)
                self.logits[size] = runner.model.compute_logits(hidden, runner.ops)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(runner.device)

    def can_replay(self, size: int) -> bool:
        return size in self.graphs

    def replay(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Logits [size, V] of one padded decode step; valid until the next replay."""
        size = input_ids.shape[0]
        self.buffers.copy_from(input_ids, batch)
        self.graphs[size].replay()
        return self.logits[size]

    def destroy(self) -> None:
        """Release the graphs and their pool (before the process tears CUDA down)."""
        self.graphs.clear()
        self.logits.clear()
        self.pool = None
        torch.cuda.synchronize(self.runner.device)
        torch.cuda.empty_cache()
