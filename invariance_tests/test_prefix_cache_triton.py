"""Prefix-cache hits keep the bits on the Triton backend (every op a ``kernels/`` launcher, under
the interpreter), for tiny dense, MoE and MLA (latent cache) models.

Property: with caching on, requests whose prompts share a 76-token prefix (one arriving while the
first decodes, with n = 2) get the token ids, logprobs and fingerprints each has alone on an
engine with caching off. Configs: batch_invariant (fp32 prefill tile 64: hits at multiples of 64),
corun packed with C = 64 (a multiple of the tile: hits at 64, the suffix's first chunk [64, 79)
starting inside no uncached chunk boundary but on a tile) and corun packed with C = 16 below the
tile (hits at multiples of C).

Negative control: blocks written by decode steps (split-KV decode attention at M = 1) served as
prompt blocks change a later request's bits. Under the interpreter the kernels keep more than
they promise for granularity: reuse at block granularity (8, below the 64-token tile) kept these
bits in every model tried, so that negative control lives on the torch backend
(tests/engine/test_prefix_cache.py), where the unpromised reuse does change them.
"""

from __future__ import annotations

import os

import pytest

from corun.config import EngineConfig
from tests.engine.prefix_workload import (
    Req,
    prompt,
    register_decode_blocks_too,
    run_each_alone,
    run_workload,
)

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="the CPU engine on the Triton interpreter; on a GPU the lead's bench_offline "
           "shared-prefix run compares caching on and off")
BASE = dict(backend="triton", device="cpu", dtype="float32", max_num_seqs=4, max_model_len=96,
            block_size=8, max_num_batched_tokens=96)
CONFIGS = {
    "batch_invariant": dict(mode="batch_invariant", prefill_chunk_size=64),
    "corun-C64": dict(mode="corun", prefill_chunk_size=64, prefill_step_tokens=96,
                      max_prefill_seqs_per_step=4, prefill_token_budget=96),
    "corun-C16": dict(mode="corun", prefill_chunk_size=16, prefill_step_tokens=32,
                      max_prefill_seqs_per_step=4, prefill_token_budget=32),
}
SHARED = prompt(1, 76)
REQUESTS = [Req("a", SHARED + prompt(2, 6), max_tokens=2),
            Req("b", SHARED + prompt(3, 3), arrival_step=2, max_tokens=2, n=2, seed=9)]


def check_hit_equals_miss(model: str, name: str) -> None:
    config = EngineConfig(model=model, **BASE, **CONFIGS[name])
    on = run_workload(config, REQUESTS)
    # b's two samples hit the 64 cached tokens a's prefill wrote (72 shared, cut to the unit).
    assert on.stats["prefix_cache_hits"] == 2 * 64
    assert on.results == run_each_alone(config, REQUESTS)


# The MLA model's cases and the chunks below the tile (on the dense tiny-qwen3) are in
# test_prefix_cache_triton_mla.py: under the interpreter each case runs for minutes, and
# pytest-xdist spreads files over workers. tiny-qwen3-moe's first layer is dense (mlp_only_layers),
# so this model runs the dense and the routed MLP paths in one case.
@pytest.mark.slow
@pytest.mark.parametrize("name", ["batch_invariant", "corun-C64"])
def test_hit_equals_miss_on_the_triton_backend(name):
    check_hit_equals_miss("tiny-qwen3-moe", name)


@pytest.mark.slow
def test_reusing_decode_written_blocks_changes_bits_negative_control(monkeypatch):
    """b's prompt is a's prompt plus a's 8 output tokens: with a's decode-written blocks
    registered, b hits 64 tokens of which 6 were decoded, and without path invariance its bits
    change (the decode's attention splits are not the prefill's). (A short decode: every step
    runs the model through the interpreter.)"""
    config = EngineConfig(model="tiny-qwen3", **BASE, **CONFIGS["batch_invariant"],
                          path_invariant=False)
    first = Req("a", prompt(1, 58), max_tokens=8)
    output = run_workload(config, [first]).results["a"][0][0]
    requests = [first, Req("b", prompt(1, 58) + output + prompt(6, 3), arrival_step=18,
                           max_tokens=2)]
    alone = run_each_alone(config, requests)
    register_decode_blocks_too(monkeypatch)
    broken = run_workload(config, requests)
    assert broken.stats["prefix_cache_hits"] == 64
    assert broken.results["a"] == alone["a"] and broken.results["b"] != alone["b"]
