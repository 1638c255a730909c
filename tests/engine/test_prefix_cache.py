"""Prefix caching: block hashes, the allocator's cached blocks and LRU, the reuse granularity, and
hit == miss bitwise end to end on the CPU engine (torch backend; the Triton backend under the
interpreter is invariance_tests/test_prefix_cache_triton.py and test_prefix_cache_triton_mla.py).

Hit == miss: a request's token ids, logprobs and fingerprint are the same with caching on (its
prefix taken from blocks another sequence prefilled) as alone on an engine with caching off, for
partial, full and repeated hits, n > 1, co-runners sharing a prefix that arrive at different
steps, eviction under a tight pool and preemption of a sequence holding shared blocks. Each
scenario also asserts that it hit, so a cache that never hits cannot pass it.

Negative controls: reuse at a granularity the kernels do not promise (block_size under corun on
the torch backend, where the suffix's first chunk then multiplies other query counts than
uncached) and blocks written by decode steps reused as prompt blocks: the bits change.
"""

from __future__ import annotations

import dataclasses
import hashlib
from array import array

import pytest

from corun.config import EngineConfig
from corun.engine import LLMEngine
from corun.kv_cache import BlockAllocator, BlockManager
from corun.prefix_cache import ROOT_HASH, hash_block, prompt_block_hashes
from corun.sampling_params import SamplingParams
from corun.sequence import Sequence
from tests.engine.conftest import TINY
from tests.engine.prefix_workload import (
    Req,
    prompt,
    register_decode_blocks_too,
    run_each_alone,
    run_workload,
)

# -- hashes ------------------------------------------------------------------------------------


def test_block_hashes_chain_the_whole_prefix():
    a = prompt_block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert len(a) == 2  # the partial third block has no hash
    assert a[0] == hashlib.sha256(ROOT_HASH + array("q", [1, 2, 3, 4]).tobytes()).digest()
    assert a[1] == hash_block(a[0], [5, 6, 7, 8])
    b = prompt_block_hashes([1, 2, 3, 4, 5, 6, 7, 0], 4)
    assert b[0] == a[0] and b[1] != a[1]
    # Same tokens after a different first block: a different hash (the parent is in the key).
    c = prompt_block_hashes([0, 2, 3, 4, 5, 6, 7, 8], 4)
    assert c[1] != a[1]
    assert prompt_block_hashes([1, 2, 3], 4) == []


# -- allocator ---------------------------------------------------------------------------------


def test_cached_block_stays_free_but_hits_until_evicted():
    alloc = BlockAllocator(3)
    (block,) = alloc.allocate(1)
    assert alloc.register(block, b"h0")
    assert not alloc.register(block, b"other") and alloc.lookup(b"other") is None
    alloc.free([block])
    assert alloc.num_free_blocks == 3 and alloc.lookup(b"h0") == block
    alloc.take_cached([block])  # a hit: held again, out of the LRU
    assert alloc.num_free_blocks == 2
    alloc.free([block])
    # Never-cached blocks go first; the cached one is evicted only when nothing else is free.
    first = alloc.allocate(2)
    assert block not in first and alloc.lookup(b"h0") == block
    (evicted,) = alloc.allocate(1)
    assert evicted == block and alloc.lookup(b"h0") is None and alloc.num_evictions == 1


def test_lru_evicts_least_recently_freed_first():
    alloc = BlockAllocator(3)
    blocks = alloc.allocate(3)
    for i, block in enumerate(blocks):
        alloc.register(block, bytes([i]))
    alloc.free([blocks[1]])
    alloc.free([blocks[0]])
    alloc.free([blocks[2]])
    alloc.take_cached([blocks[1]])  # used again: no longer the oldest
    alloc.free([blocks[1]])
    assert alloc.allocate(1) == [blocks[0]]
    assert alloc.allocate(1) == [blocks[2]]
    assert alloc.lookup(bytes([1])) == blocks[1]


def test_duplicate_hash_keeps_the_first_block():
    alloc = BlockAllocator(2)
    a, b = alloc.allocate(2)
    assert alloc.register(a, b"h") and not alloc.register(b, b"h")
    alloc.free([b])
    assert alloc.num_free_blocks == 1 and alloc.lookup(b"h") == a
    with pytest.raises(RuntimeError, match="not cached"):
        alloc.take_cached([b])


def _seq(seq_id: int, prompt_ids: list[int]) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", 0, prompt_ids, SamplingParams(), 7)


def test_hits_are_rounded_to_the_granularity_and_leave_the_last_token():
    manager = BlockManager(16, block_size=4, cache_granularity=8)
    owner = _seq(0, list(range(1, 18)))  # 17 tokens: 4 full blocks
    manager.admit(owner, [], 17)
    owner.num_computed_tokens = 17
    manager.register_prefill(owner)
    assert owner.num_cached_blocks == 4  # 16 tokens: two whole units of 8
    assert len(manager.cached_prefix(_seq(1, list(range(1, 18))))) == 4
    # 16 tokens shared exactly: the whole prompt would be cached, so one unit is recomputed.
    assert len(manager.cached_prefix(_seq(2, list(range(1, 17))))) == 2
    # 14 shared tokens: 3 cached blocks, cut to one unit of 8.
    assert len(manager.cached_prefix(_seq(3, [*range(1, 15), 0, 0, 0]))) == 2
    assert manager.cached_prefix(_seq(4, [9, *range(2, 18)])) == []
    hit = _seq(5, list(range(1, 20)))
    prefix = manager.cached_prefix(hit)
    manager.admit(hit, prefix, 19)
    assert hit.num_computed_tokens == 16 and hit.block_table[:4] == owner.block_table[:4]
    assert (manager.num_prefix_queries, manager.num_prefix_hits) == (17 + 19, 16)


def test_only_whole_units_of_prompt_prefill_are_registered():
    manager = BlockManager(16, block_size=4, cache_granularity=8)
    seq = _seq(0, list(range(1, 11)))  # 10 prompt tokens
    manager.admit(seq, [], 12)
    seq.num_computed_tokens = 6
    manager.register_prefill(seq)
    assert seq.num_cached_blocks == 0  # 6 tokens: no whole unit yet
    seq.num_computed_tokens = 10
    manager.register_prefill(seq)
    assert seq.num_cached_blocks == 2 and manager.allocator.num_cached_blocks == 2
    for token in range(6):
        seq.append_token(token)
    manager.grow(seq, 16)
    # 16 tokens computed: a whole second unit, but decode steps wrote most of it.
    seq.num_computed_tokens = 16
    manager.register_prefill(seq)
    assert seq.num_cached_blocks == 2 and manager.allocator.num_cached_blocks == 2


def test_release_frees_the_tail_first():
    manager = BlockManager(8, block_size=4, cache_granularity=4)
    seq = _seq(0, list(range(1, 14)))
    manager.admit(seq, [], 13)
    seq.num_computed_tokens = 13
    manager.register_prefill(seq)
    table = list(seq.block_table)
    manager.release(seq)
    # The 5 never-cached blocks (the 4 unused ones and the partial last block), then one
    # eviction: the last cached block, not the head.
    fresh = manager.allocator.allocate(5 + 1)
    assert table[2] in fresh and table[0] not in fresh and table[1] not in fresh
    assert len(manager.cached_prefix(_seq(1, list(range(1, 14))))) == 2


def test_admission_counts_evictable_prefix_blocks_as_used():
    manager = BlockManager(4, block_size=4, cache_granularity=4)
    owner = _seq(0, list(range(1, 10)))
    manager.admit(owner, [], 9)
    owner.num_computed_tokens = 9
    manager.register_prefill(owner)
    manager.release(owner)
    seq = _seq(1, [*range(1, 9), 50, 51, 52, 53, 54])
    prefix = manager.cached_prefix(seq)
    assert len(prefix) == 2
    # Two evictable prefix blocks taken plus two new ones: all four free blocks.
    assert manager.num_blocks_to_admit(seq, prefix, 13) == 4


# -- config ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw, expected", [
    (dict(mode="batch_invariant"), 4),  # torch backend: any start keeps the bits
    (dict(mode="corun"), 8),  # torch corun attention: cut exactly as uncached, at C
    (dict(mode="corun", prefill_policy="isolated"), 8),
    (dict(mode="corun", backend="triton", prefill_chunk_size=64, prefill_step_tokens=64), 64),
    (dict(mode="corun", backend="triton", prefill_chunk_size=128, prefill_step_tokens=128,
          prefill_policy="isolated"), 128),
    (dict(mode="corun", backend="triton", prefill_chunk_size=16), 16),  # C below the tile
    (dict(mode="batch_invariant", backend="triton", prefill_chunk_size=64,
          max_num_batched_tokens=64), 64),
    (dict(mode="batch_invariant", backend="triton", dtype="bfloat16",
          prefill_chunk_size=128, max_num_batched_tokens=128), 128),
    (dict(mode="default", backend="triton"), 64),
    (dict(mode="corun", enable_prefix_caching=False), None),
])
def test_prefix_cache_granularity(kw, expected):
    assert EngineConfig(**dict(TINY, **kw)).prefix_cache_granularity == expected


def test_enable_prefix_caching_must_be_a_bool():
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineConfig(**dict(TINY, enable_prefix_caching=1))


# -- hit == miss end to end --------------------------------------------------------------------

SYSTEM = prompt(1, 29)  # a shared 29-token "system prompt"
SCENARIOS = {
    # questions after a shared system prompt: partial hits (the shared part, rounded down)
    "partial": [Req("a", SYSTEM + prompt(2, 6)), Req("b", SYSTEM + prompt(3, 9), arrival_step=4),
                Req("c", SYSTEM[:20] + prompt(4, 5), arrival_step=4)],
    # one prompt again, whole: a full hit recomputes the last unit only
    "full": [Req("a", SYSTEM[:24]), Req("b", SYSTEM[:24], arrival_step=5, seed=3)],
    # the same prompt three times, later ones hitting blocks the second one also holds
    "repeated": [Req("a", SYSTEM, seed=1), Req("b", SYSTEM, arrival_step=4, seed=2),
                 Req("c", SYSTEM, arrival_step=8, seed=3)],
    # n = 3 samples of one prompt, and a question sharing it
    "n>1": [Req("a", SYSTEM, n=3, seed=5), Req("b", SYSTEM + prompt(5, 4), arrival_step=2)],
    # co-runners sharing the prefix arrive at different steps (mid-prefill, mid-decode)
    "staggered": [Req(f"q{i}", SYSTEM + prompt(10 + i, 3 + i), arrival_step=step, seed=i)
                  for i, step in enumerate([0, 1, 3, 6])],
}
MODES = [("corun", {}), ("corun", dict(prefill_policy="isolated")), ("batch_invariant", {})]
MODE_IDS = ["corun-packed", "corun-isolated", "batch_invariant"]


def _config(mode: str, **kw) -> EngineConfig:
    return EngineConfig(**dict(TINY, mode=mode, **kw))


@pytest.mark.parametrize("mode, kw", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_hit_equals_miss(mode, kw, scenario):
    config = _config(mode, **kw)
    requests = SCENARIOS[scenario]
    on = run_workload(config, requests)
    assert on.stats["prefix_cache_hits"] > 0, "the scenario never hit the cache"
    assert on.stats["prefix_cache_hits"] % config.prefix_cache_granularity == 0
    assert on.results == run_each_alone(config, requests)
    off = run_workload(dataclasses.replace(config, enable_prefix_caching=False), requests)
    assert off.stats["prefix_cache_queries"] == 0 and off.results == on.results


@pytest.mark.parametrize("mode, kw", MODES, ids=MODE_IDS)
def test_hit_equals_miss_with_eviction_under_a_tight_pool(mode, kw):
    """16 blocks of 4 tokens (one max_model_len sequence): cached blocks are evicted and taken
    over while other prompts come and go; every hit still equals its miss."""
    config = _config(mode, num_kv_blocks=16, **kw)
    requests = [Req("a", SYSTEM + prompt(2, 3)), Req("x", prompt(7, 30), arrival_step=3),
                Req("b", SYSTEM + prompt(3, 5), arrival_step=3),
                Req("y", prompt(8, 26), arrival_step=9), Req("c", SYSTEM, arrival_step=12)]
    on = run_workload(config, requests)
    assert on.stats["num_prefix_evictions"] > 0, "the pool never evicted a cached block"
    assert on.stats["prefix_cache_hits"] > 0
    assert on.results == run_each_alone(config, requests)


@pytest.mark.parametrize("mode, kw", MODES, ids=MODE_IDS)
def test_preempting_a_sequence_that_holds_shared_blocks_keeps_the_bits(mode, kw):
    """Two requests share a cached prefix and outgrow a one-sequence pool while decoding: the
    later one is swapped out holding shared blocks, comes back in other blocks, and both end
    with their bits alone."""
    config = _config(mode, num_kv_blocks=16, **kw)
    requests = [Req("a", SYSTEM, max_tokens=20), Req("b", SYSTEM + (5,), arrival_step=4,
                                                      max_tokens=20)]
    on = run_workload(config, requests)
    assert on.stats["prefix_cache_hits"] > 0 and on.num_preemptions["b"] > 0
    assert on.results == run_each_alone(config, requests)


def test_stats_report_the_hit_rate():
    config = _config("corun")
    on = run_workload(config, SCENARIOS["repeated"])
    stats = on.stats
    assert stats["prefix_cache_queries"] == 3 * len(SYSTEM)
    assert stats["prefix_cache_hits"] == 2 * 24  # 29 tokens: 3 units of 8 cached
    assert stats["prefix_cache_hit_rate"] == pytest.approx(48 / 87)


# -- negative controls -------------------------------------------------------------------------


def test_reuse_below_the_promised_granularity_changes_bits_negative_control():
    """corun on the torch backend without path invariance promises a hit at multiples of C = 8
    only: its prefill attention multiplies a chunk's queries together, so a suffix chunk
    starting at a block boundary inside an uncached chunk (the last token alone at 28, where
    uncached it is one of the five queries of chunk [24, 29)) gives its rows other bits. (With
    path invariance every prefill row is its decode's computation, one query at a time.)"""
    config = _config("corun", path_invariant=False)
    requests = SCENARIOS["repeated"]
    alone = run_each_alone(config, requests)
    promised = run_workload(config, requests)
    assert promised.results == alone
    unpromised = run_workload(config, requests, granularity=config.block_size)
    assert unpromised.stats["prefix_cache_hits"] > promised.stats["prefix_cache_hits"]
    assert unpromised.results != alone


def test_reusing_decode_written_blocks_changes_bits_negative_control(monkeypatch):
    """A prompt equal to an earlier request's prompt plus its output: letting the blocks its
    decode steps wrote serve as prompt blocks changes the later request's bits (without path
    invariance decode K/V are other bits than prefill K/V of the same tokens: corun's GEMM at
    M = 1 is not its GEMM at a prefill's M); the prefill-only rule keeps them."""
    config = _config("corun", max_num_seqs=2, path_invariant=False)
    first = Req("a", SYSTEM[:12], max_tokens=14)
    engine_output = run_workload(config, [first]).results["a"][0][0]
    # "b" arrives once "a" has finished (its blocks stay cached, evictable).
    follow = Req("b", SYSTEM[:12] + engine_output + prompt(6, 3), arrival_step=14)
    requests = [first, follow]
    alone = run_each_alone(config, requests)
    assert run_workload(config, requests).results == alone

    register_decode_blocks_too(monkeypatch)
    broken = run_workload(config, requests)
    assert broken.stats["prefix_cache_hits"] > 16, "b did not reuse a's decode-written blocks"
    assert broken.results["a"] == alone["a"] and broken.results["b"] != alone["b"]


def test_a_prompt_logprobs_request_is_no_prefix_cache_query():
    """The hit rate is hits over the prompt tokens *looked up* at admission (vLLM's queries). A
    request asking for prompt logprobs computes its whole prompt without a look-up, so it is no
    query: counting its tokens made the rate fall whenever such requests ran (vLLM skips them
    too)."""
    config = _config("corun")
    engine = LLMEngine(config)
    scoring = SamplingParams(max_tokens=1, prompt_logprobs=0, seed=0)
    engine.add_request(list(SYSTEM), scoring, "score")
    run_workload(config, [], engine=engine)
    assert engine.stats()["prefix_cache_queries"] == 0
    engine.add_request(list(SYSTEM), SamplingParams(max_tokens=1, seed=0), "plain")
    run_workload(config, [], engine=engine)
    stats = engine.stats()
    assert stats["prefix_cache_queries"] == len(SYSTEM)
    assert stats["prefix_cache_hits"] == 24  # the scoring request's blocks were registered
