"""BlockAllocator / BlockManager: allocation, growth without moving blocks, freeing, errors."""

import pytest

from corun.kv_cache import BlockAllocator, BlockManager
from corun.sampling_params import SamplingParams
from corun.sequence import Sequence


def _seq(seq_id: int, prompt_len: int) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", 0, list(range(1, prompt_len + 1)), SamplingParams(), 7)


def test_allocate_free_roundtrip():
    alloc = BlockAllocator(4)
    blocks = alloc.allocate(3)
    assert len(set(blocks)) == 3 and alloc.num_free_blocks == 1
    assert not alloc.can_allocate(2)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        alloc.allocate(2)
    alloc.free(blocks)
    assert alloc.num_free_blocks == 4 and alloc.num_used_blocks == 0
    with pytest.raises(RuntimeError, match="freed twice"):
        alloc.free(blocks[:1])


def test_refcount_keeps_shared_block_until_last_free():
    alloc = BlockAllocator(2)
    (block,) = alloc.allocate(1)
    alloc.incref([block])
    alloc.free([block])
    assert alloc.num_free_blocks == 1
    alloc.free([block])
    assert alloc.num_free_blocks == 2


def test_bad_sizes_raise_value_error():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(0)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, 0)


def test_growth_appends_and_never_moves_blocks():
    manager = BlockManager(8, block_size=4)
    seq = _seq(0, 5)
    manager.grow(seq, 5)
    first = list(seq.block_table)
    assert len(first) == 2
    manager.grow(seq, 8)  # still fits in two blocks
    assert seq.block_table == first
    manager.grow(seq, 9)
    assert seq.block_table[:2] == first and len(seq.block_table) == 3
    assert manager.slot(seq, 8) == seq.block_table[2] * 4
    assert manager.slot(seq, 5) == first[1] * 4 + 1
    released = manager.release(seq)
    assert released[:2] == first and seq.block_table == [] and manager.num_free_blocks == 8


def test_can_grow_counts_only_missing_blocks():
    manager = BlockManager(3, block_size=4)
    a, b = _seq(0, 4), _seq(1, 4)
    manager.grow(a, 8)
    assert manager.can_grow(b, 4) and not manager.can_grow(b, 5)
    assert manager.can_grow(a, 12) and not manager.can_grow(a, 13)
