"""GraphRunner: fixed-shape steps captured as CUDA graphs, then replayed.

A graph is captured per ``StepShape`` (decode at each bucket, corun's prefill shapes), from a
forward closure whose inputs are views of the runner's static step buffers (``corun.step_inputs``):
replaying is "fill the buffers, replay, read the static outputs". Within a *pool group* graphs are
captured largest first into one memory pool (the smaller ones reuse the largest one's
activations); the decode graphs and the prefill graphs live in two groups, because under
``overlap_prefill_decode`` a decode graph and a prefill graph run at the same time on two streams
and must not share intermediate memory.

Graph replay gives exactly the eager forward's bits: the same kernels with the same configs run
on the same shapes (the captured host ints are the shape's constants, which eager uses too).
CPU runs never get here (CUDA graphs need CUDA; the engine runs eagerly).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class GraphRunner:
    """CUDA graphs keyed by step shape, each with the outputs its replay writes."""

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda" or not torch.cuda.is_available():
            raise RuntimeError("CUDA graphs need a CUDA device; run eagerly on the CPU")
        self.device = device
        self.graphs: dict[Any, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[Any, Any] = {}
        self.pools: dict[str, Any] = {}

    @torch.inference_mode()
    def capture(self, key: Any, group: str, forward: Callable[[], Any],
                num_warmups: int = 2) -> None:
        """Capture ``forward`` (no arguments: it reads static buffers) under ``key``.

        Warm-up runs go first, eagerly: JIT compilation and lazy allocations must not be captured.
        Capture the largest shape of a group first so the rest fit in its pool.
        """
        for _ in range(num_warmups):
            forward()
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pools.get(group)):
            self.outputs[key] = forward()
        if group not in self.pools:
            self.pools[group] = graph.pool()
        self.graphs[key] = graph
        torch.cuda.synchronize(self.device)

    def can_replay(self, key: Any) -> bool:
        return key in self.graphs

    def replay(self, key: Any) -> Any:
        """Replay on the current stream; returns the static outputs (valid until the next
        replay of this graph)."""
        self.graphs[key].replay()
        return self.outputs[key]

    def destroy(self) -> None:
        """Release the graphs and their pools (before the process tears CUDA down)."""
        self.graphs.clear()
        self.outputs.clear()
        self.pools.clear()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
