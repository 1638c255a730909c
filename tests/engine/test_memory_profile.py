"""The memory profile's steps (corun.memory_profile.profile_steps) run on any model at any sizes.

On the GPU the profile runs the largest prefill step once with the largest contexts it can
expand; MLA expands every row's cached context through the block table. A step of more tokens
than ``max_model_len`` (DeepSeek-V3 under ``default`` with a 2048-token budget and shorter
sequences) once indexed past the block table's columns: a device-side assert on the H200.
"""

from __future__ import annotations

import pytest
import torch

from corun.config import EngineConfig
from corun.memory_profile import profile_context_lens, profile_steps
from corun.model_runner import ModelRunner
from models.forward_batch import KVCache


def test_profile_context_lens_cut_the_step_into_sequences_that_fit():
    assert profile_context_lens(1000, 4096, 8) == (1000,)
    assert profile_context_lens(8192, 3000, 8) == (3000, 3000, 2192)
    assert profile_context_lens(8192, 1000, 3) == (1000, 1000, 1000)  # as far as the rows go
    assert profile_context_lens(0, 64, 4) == ()


@pytest.mark.parametrize("mode", ["default", "corun"])
def test_profile_steps_run_when_a_step_holds_more_tokens_than_a_sequence(mode):
    config = EngineConfig(model="tiny-deepseek-v3", device="cpu", dtype="float32", mode=mode,
                          max_num_seqs=4, max_model_len=48, num_kv_blocks=64,
                          max_num_batched_tokens=160, prefill_chunk_size=16,
                          prefill_step_tokens=128, max_prefill_seqs_per_step=4,
                          prefill_token_budget=128)
    runner = ModelRunner(config)
    scratch = KVCache(runner.model.kv_cache_spec(), 1, config.block_size, runner.dtype,
                      runner.device)
    prefill = 0
    with torch.inference_mode():
        for _, bound, batch in profile_steps(runner, scratch):
            if bound.shape.is_prefill:
                prefill += 1
                assert max(batch.context_lens_host) <= config.max_model_len
                assert sum(batch.context_lens_host) > config.max_model_len
            # The scratch cache is uninitialised memory: only that every row ran is checked (an
            # index past the block table raises on the CPU, asserts on the GPU).
            _, _, hidden = runner.forward(bound, batch)
            assert hidden.shape[0] == bound.input_ids.shape[0]
    assert prefill == 1
