"""KV block bookkeeping, pure Python: which physical blocks hold which sequence's tokens.

The device tensors live in ``models.forward_batch.KVCache``; this module only hands out block ids.
A sequence's block table grows by appending blocks (copy-free growth), and returns them all when it
finishes, is aborted or is swapped out. Block ids never reach the numerics: attention gathers
through the block table, so which physical block a token lands in cannot change its bits (that is
what lets a swapped-out sequence come back in other blocks and continue bitwise the same).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from corun.sequence import Sequence


class BlockAllocator:
    """A free list of ``num_blocks`` block ids with reference counts."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks: expected >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks < 0:
            raise ValueError(f"num_blocks: expected >= 0, got {num_blocks}")
        if num_blocks > len(self._free):
            raise RuntimeError(f"out of KV blocks: {num_blocks} asked, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(num_blocks)]
        for block in blocks:
            self._ref_counts[block] = 1
        return blocks

    def incref(self, blocks: Iterable[int]) -> None:
        """Share blocks (a forked sequence); each is freed when its last holder frees it."""
        for block in blocks:
            if self._ref_counts[block] < 1:
                raise RuntimeError(f"block {block} is not allocated")
            self._ref_counts[block] += 1

    def free(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            if self._ref_counts[block] < 1:
                raise RuntimeError(f"block {block} freed twice")
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free.append(block)


class BlockManager:
    """Block tables of sequences on top of a BlockAllocator, ``block_size`` tokens per block."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size: expected >= 1, got {block_size}")
        self.allocator = BlockAllocator(num_blocks)
        self.block_size = block_size

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_missing_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks ``seq`` still needs so that its first ``num_tokens`` tokens have a slot."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.allocator.can_allocate(self.num_missing_blocks(seq, num_tokens))

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Append blocks until ``num_tokens`` tokens fit; existing blocks are never moved."""
        seq.block_table.extend(self.allocator.allocate(self.num_missing_blocks(seq, num_tokens)))

    def release(self, seq: Sequence) -> list[int]:
        """Return all of ``seq``'s blocks to the free list; gives back the ids it held."""
        blocks, seq.block_table = seq.block_table, []
        self.allocator.free(blocks)
        return blocks

    def slot(self, seq: Sequence, position: int) -> int:
        """Flat cache slot (block * block_size + offset) of token ``position`` of ``seq``."""
        return seq.block_table[position // self.block_size] * self.block_size + (
            position % self.block_size
        )
