"""Routing replay: the experts every MoE layer sent each token to, kept per KV slot.

With ``EngineConfig.enable_return_routed_experts`` each MoE layer writes its top-k expert ids at
the step's ``slot_mapping`` into one device table beside the KV cache (vLLM's and SGLang's
"routing replay" data): a token's row lives as long as its K/V, so a prefix-cache hit, a sibling
sample's shared prompt and a swapped-out sequence (its rows go to host memory with its blocks)
all keep theirs. When a sequence finishes, its rows are gathered through its block table:
``CompletionOutput.routed_experts`` [tokens, MoE layers, k] for every token the model read (the
prompt and all sampled tokens but the last, which no step reads). The write is one indexed copy
per MoE layer per step, inside the step's CUDA graph; the read is one gather per finished
sequence. A trainer can check its own routing against it, or force it (replay).
"""

from __future__ import annotations

import numpy as np
import torch


class RoutedExperts:
    """The table [num_slots + 1, MoE layers, top_k] (the last row takes padding tokens' writes)
    and the map from a model layer index to its column."""

    def __init__(self, num_slots: int, block_size: int, moe_layers: list[int], top_k: int,
                 num_experts: int, device: torch.device) -> None:
        dtype = torch.int16 if num_experts < 2**15 else torch.int32
        self.block_size = block_size
        self.spare = num_slots  # padding tokens (slot -1) write here
        self.column = {layer: i for i, layer in enumerate(moe_layers)}
        self.table = torch.full((num_slots + 1, len(moe_layers), top_k), -1, dtype=dtype,
                                device=device)

    def record(self, layer_idx: int, slot_mapping: torch.Tensor, ids: torch.Tensor) -> None:
        """A MoE layer's top-k ids [T, k] at the step's slots (device ops, no host sync)."""
        slots = torch.where(slot_mapping >= 0, slot_mapping, self.spare)
        self.table[slots, self.column[layer_idx]] = ids.to(self.table.dtype)

    def read(self, block_table: list[int], num_tokens: int) -> np.ndarray:
        """A sequence's rows for positions 0 .. num_tokens - 1: [num_tokens, layers, k]."""
        pos = torch.arange(num_tokens)
        blocks = torch.tensor(block_table, dtype=torch.int64)[pos // self.block_size]
        slots = (blocks * self.block_size + pos % self.block_size).to(self.table.device)
        return self.table.index_select(0, slots).cpu().numpy()

    def block_rows(self, blocks: list[int]) -> torch.Tensor:
        """The rows of whole blocks (a swap-out's host copy)."""
        rows = (torch.tensor(blocks, dtype=torch.int64).view(-1, 1) * self.block_size
                + torch.arange(self.block_size)).view(-1).to(self.table.device)
        return self.table.index_select(0, rows).cpu()

    def restore(self, blocks: list[int], rows: torch.Tensor) -> None:
        """Put a swap-out's rows back into the sequence's new blocks (a swap-in)."""
        index = (torch.tensor(blocks, dtype=torch.int64).view(-1, 1) * self.block_size
                 + torch.arange(self.block_size)).view(-1).to(self.table.device)
        self.table.index_copy_(0, index, rows.to(self.table.device))
