"""KV block bookkeeping, pure Python: which physical blocks hold which sequence's tokens.

The device tensors live in ``models.forward_batch.KVCache``; this module only hands out block ids.
A sequence's block table grows by appending blocks (copy-free growth), and returns them all when it
finishes, is aborted or is swapped out. Block ids never reach the numerics: attention gathers
through the block table, so which physical block a token lands in cannot change its bits (that is
what lets a swapped-out sequence come back in other blocks and continue bitwise the same).

Prefix caching (vLLM's design, DESIGN.md "Prefix caching"): a full prompt block whose K/V the
prefill path wrote is registered under the hash of its tokens and of everything before it
(``corun.prefix_cache``). A later sequence whose prompt starts with the same blocks takes them
instead of recomputing them (a reference more each). A cached block nobody holds stays in an LRU
of evictable blocks, still counted as free: allocation takes never-cached blocks first, then evicts
the least recently freed cached block. A hit is rounded down to the config's
``prefix_cache_granularity``, the reuse unit at which a suffix computed after the cached prefix
has exactly the bits of the same rows of an uncached prefill.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable

from corun.prefix_cache import prompt_block_hashes
from corun.sequence import Sequence


class BlockAllocator:
    """A free list of ``num_blocks`` block ids with reference counts, and the hash -> block map
    of cached blocks (free cached blocks in an LRU, evicted least recently used first)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks: expected >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))  # never cached (or evicted)
        self._ref_counts = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        # Cached blocks with no holder, least recently freed first: free, but kept for a hit
        # until an allocation needs them.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered under a hash (held or evictable)."""
        return len(self._hash_of)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks < 0:
            raise ValueError(f"num_blocks: expected >= 0, got {num_blocks}")
        if num_blocks > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: {num_blocks} asked, "
                               f"{self.num_free_blocks} free")
        blocks = []
        for _ in range(num_blocks):
            if self._free:
                block = self._free.popleft()
            else:  # evict the least recently used cached block: its hash no longer hits
                block, _ = self._evictable.popitem(last=False)
                del self._block_of[self._hash_of.pop(block)]
                self.num_evictions += 1
            self._ref_counts[block] = 1
            blocks.append(block)
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
                if block in self._hash_of:
                    self._evictable[block] = None  # most recently used end
                else:
                    self._free.append(block)

    # -- prefix cache ------------------------------------------------------------------------------

    def lookup(self, block_hash: bytes) -> int | None:
        """The cached block registered under ``block_hash``, held or evictable."""
        return self._block_of.get(block_hash)

    def is_evictable(self, block: int) -> bool:
        return self._ref_counts[block] == 0 and block in self._evictable

    def take_cached(self, blocks: Iterable[int]) -> None:
        """Hold cached blocks for one more sequence (a hit); an evictable one leaves the LRU."""
        for block in blocks:
            if block not in self._hash_of:
                raise RuntimeError(f"block {block} is not cached")
            if self._ref_counts[block] == 0:
                del self._evictable[block]
            self._ref_counts[block] += 1

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (the weights changed: K/V computed under the old ones
        must never be served again). Evictable blocks go back to the free list, held ones
        stay held but will not hit; returns how many blocks were cached."""
        dropped = len(self._hash_of)
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._hash_of.clear()
        self._block_of.clear()
        return dropped

    def register(self, block: int, block_hash: bytes) -> bool:
        """Make held ``block`` hit for ``block_hash``. A hash already cached keeps its block (the
        first computation of a prefix serves it; the duplicate is freed as uncached)."""
        if self._ref_counts[block] < 1:
            raise RuntimeError(f"block {block} is not allocated")
        if block_hash in self._block_of or block in self._hash_of:
            return False
        self._block_of[block_hash] = block
        self._hash_of[block] = block_hash
        return True


class BlockManager:
    """Block tables of sequences on top of a BlockAllocator, ``block_size`` tokens per block.

    ``cache_granularity``: the prefix cache's reuse unit in tokens (a multiple of
    ``block_size``), or None for no prefix caching.
    """

    def __init__(self, num_blocks: int, block_size: int,
                 cache_granularity: int | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size: expected >= 1, got {block_size}")
        if cache_granularity is not None and (
                cache_granularity < 1 or cache_granularity % block_size):
            raise ValueError(f"cache_granularity: expected a positive multiple of block_size "
                             f"{block_size}, got {cache_granularity}")
        self.allocator = BlockAllocator(num_blocks)
        self.block_size = block_size
        self.cache_granularity = cache_granularity
        self.num_prefix_queries = 0  # prompt tokens of admitted sequences that looked up
        self.num_prefix_hits = 0  # of those, tokens taken from the cache

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks

    @property
    def is_caching(self) -> bool:
        return self.cache_granularity is not None

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
        """Return all of ``seq``'s blocks to the free list; gives back the ids it held.

        Freed last block first, so that under memory pressure the LRU evicts a prefix's tail
        before its head (a head block serves every longer prefix; a tail without it serves none).
        """
        blocks, seq.block_table = seq.block_table, []
        self.allocator.free(reversed(blocks))
        seq.num_cached_blocks = 0
        return blocks

    def slot(self, seq: Sequence, position: int) -> int:
        """Flat cache slot (block * block_size + offset) of token ``position`` of ``seq``."""
        return seq.block_table[position // self.block_size] * self.block_size + (
            position % self.block_size
        )

    # -- prefix cache ------------------------------------------------------------------------------

    def _hashes(self, seq: Sequence) -> list[bytes]:
        if seq.block_hashes is None:
            seq.block_hashes = prompt_block_hashes(seq.prompt_token_ids, self.block_size)
        return seq.block_hashes

    def looks_up(self, seq: Sequence) -> bool:
        """Whether admission looks ``seq``'s prompt up in the cache (a prefix-cache query).

        Not with caching off, and not for a request asking for prompt logprobs: it needs every
        prompt row's hidden state, so it computes its whole prompt (vLLM does the same, and
        counts no query for it); its blocks are still registered."""
        return self.is_caching and seq.params.prompt_logprobs is None

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks a waiting ``seq`` may start from: its longest cached run of prompt
        blocks, cut to a multiple of ``cache_granularity`` tokens that leaves at least the last
        prompt token to compute (its row is sampled). Takes nothing."""
        if not self.looks_up(seq) or seq.block_table:
            return []
        unit = self.cache_granularity
        max_tokens = (seq.num_prompt_tokens - 1) // unit * unit
        blocks = []
        for block_hash in self._hashes(seq)[: max_tokens // self.block_size]:
            block = self.allocator.lookup(block_hash)
            if block is None:
                break
            blocks.append(block)
        num_tokens = len(blocks) * self.block_size // unit * unit
        return blocks[: num_tokens // self.block_size]

    def num_blocks_to_admit(self, seq: Sequence, prefix: list[int], num_tokens: int) -> int:
        """Free blocks admitting ``seq`` with ``prefix`` for ``num_tokens`` tokens uses up: the
        new blocks, plus the prefix blocks that are evictable (they stop counting as free)."""
        taken = sum(self.allocator.is_evictable(b) for b in prefix)
        return max(0, self.blocks_for(num_tokens) - len(prefix)) + taken

    def admit(self, seq: Sequence, prefix: list[int], num_tokens: int) -> None:
        """Give waiting ``seq`` the cached ``prefix`` (its K/V counted computed) and new blocks
        up to ``num_tokens`` tokens; counts the prefix-cache query and hit."""
        if seq.block_table:
            raise RuntimeError(f"seq {seq.seq_id}: admitted while holding blocks")
        self.allocator.take_cached(prefix)
        seq.block_table = list(prefix)
        seq.num_cached_blocks = len(prefix)
        seq.num_computed_tokens = len(prefix) * self.block_size
        self.grow(seq, num_tokens)
        if self.looks_up(seq):
            self.num_prefix_queries += seq.num_prompt_tokens
            self.num_prefix_hits += seq.num_computed_tokens

    def register_prefill(self, seq: Sequence) -> None:
        """After a prefill chunk of ``seq`` committed: register its prompt blocks that lie in
        whole ``cache_granularity`` units the prefill path has written (never a block a decode
        step wrote: only prompt tokens, and only up to the last whole unit)."""
        if not self.is_caching:
            return
        unit = self.cache_granularity
        done = min(seq.num_computed_tokens, seq.num_prompt_tokens) // unit * unit
        last = done // self.block_size
        if last <= seq.num_cached_blocks:
            return
        hashes = self._hashes(seq)
        for index in range(seq.num_cached_blocks, last):
            self.allocator.register(seq.block_table[index], hashes[index])
        seq.num_cached_blocks = last
