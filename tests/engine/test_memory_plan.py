"""Memory planning: the KV cache sized to what the config can use, the check that refuses a
config too large for the device before allocating, and a closed engine freeing its memory."""

from __future__ import annotations

import dataclasses
import gc
import weakref

import pytest

from corun import memory_plan
from corun.config import EngineConfig
from corun.llm import LLM
from corun.serve import load_tokenizer
from tests.engine.conftest import TINY

GIB = 1 << 30


def test_gpu_cache_is_sized_to_the_config_not_to_free_memory():
    config = EngineConfig(model="tiny-qwen3", max_num_seqs=4, max_model_len=64, block_size=16)
    per_block = 4096
    # An H200's worth of free memory: the tiny model takes what 5 sequences of 4 blocks use.
    blocks = memory_plan.gpu_num_blocks(config, free=139 * GIB, total=140 * GIB, peak=GIB,
                                        per_block=per_block)
    assert blocks == memory_plan.config_num_blocks(config) == 5 * 4
    # An explicit gpu_memory_utilization sizes it from free memory (the previous behaviour).
    filled = memory_plan.gpu_num_blocks(dataclasses.replace(config, gpu_memory_utilization=0.5),
                                        free=139 * GIB, total=140 * GIB, peak=GIB,
                                        per_block=per_block)
    assert filled == (70 * GIB - GIB - GIB - memory_plan.GPU_RESERVE_BYTES) // per_block
    with pytest.raises(ValueError, match="^gpu_memory_utilization: .* less than one"):
        memory_plan.gpu_num_blocks(config, free=3 * GIB, total=140 * GIB, peak=GIB,
                                   per_block=GIB)


def test_a_config_too_large_for_the_host_is_refused_before_allocating():
    config = EngineConfig(model="qwen3-8b", dtype="float32", device="cpu", max_num_seqs=4,
                          max_model_len=256)
    plan = memory_plan.plan(config, memory_plan.model_config_of("qwen3-8b"))
    assert 30 * GIB < plan.weights_bytes < 34 * GIB  # 8.2e9 fp32 weights
    with pytest.raises(ValueError, match=r"^model: qwen3-8b .* needs about .* GiB are available"):
        memory_plan.check_fits(plan, 16 * GIB, config)
    memory_plan.check_fits(plan, 64 * GIB, config)
    # Through the engine: refused at once (it used to allocate for minutes and exhaust memory).
    with pytest.raises(ValueError, match="^model: qwen3-8b"):
        LLM("qwen3-8b", device="cpu", dtype="float32", max_num_seqs=4, max_model_len=256,
            num_kv_blocks=10**7)


def test_a_closed_engine_frees_its_weights_and_cache():
    llm = LLM(**TINY)
    runner = llm.engine.runner
    weights = weakref.ref(next(runner.model.parameters()))
    cache = weakref.ref(runner.kv_cache.storage)
    llm.close()
    gc.collect()
    assert weights() is None and cache() is None


def test_a_named_config_gets_the_server_tokenizer_offline():
    with LLM(**TINY) as llm:
        served = load_tokenizer(TINY["model"])
        assert llm.tokenizer is not None
        assert llm.tokenizer.encode("hello") == served.encode("hello")
        assert llm.engine.eos_token_ids >= frozenset(served.eos_token_ids)
        out = llm.generate("hello", use_tqdm=False)[0]
        assert out.prompt_token_ids == served.encode("hello") and isinstance(out.text, str)
