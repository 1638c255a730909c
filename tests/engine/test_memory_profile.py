"""The memory profile's steps (corun.memory_profile.profile_steps) run on any model at any sizes.

On the GPU the profile runs the largest prefill step once with the largest contexts it can
expand; MLA expands every row's cached context through the block table. A step of more tokens
than ``max_model_len`` (DeepSeek-V3 under ``default`` with a 2048-token budget and shorter
sequences) once indexed past the block table's columns: a device-side assert on the H200.
"""

from __future__ import annotations

import functools

import pytest
import torch

from corun import logits_processing, memory_plan
from corun.config import EngineConfig
from corun.memory_profile import profile_context_lens, profile_peak_bytes, profile_steps
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


@pytest.mark.parametrize("overlap", [False, True])
def test_profile_peak_bytes_adds_the_steps_peaks_as_they_can_be_in_flight(monkeypatch, overlap):
    """The GPU-only sum, run on the CPU with the CUDA peak counter replaced by one that runs the
    work and reports a size per step: every profiled step's forward and the logits processing
    run, and the peaks add as the docstring says (the larger step alone, or both under
    ``overlap_prefill_decode``, where a decode and a prefill step are in flight together)."""
    processing_bytes = 7
    ran = []

    def fake_peak(run, device):
        run()
        if isinstance(run, functools.partial) and run.func == runner.forward:
            shape = run.args[0].shape
            ran.append(shape)
            return 1000 * shape.num_tokens
        return processing_bytes

    monkeypatch.setattr(memory_plan, "cuda_peak_bytes", fake_peak)
    monkeypatch.setattr(logits_processing, "cuda_peak_bytes", fake_peak)
    config = EngineConfig(model="tiny-qwen3", device="cpu", dtype="float32", mode="corun",
                          max_num_seqs=4, decode_batch_size=4, max_model_len=64,
                          num_kv_blocks=64, prefill_chunk_size=16, prefill_step_tokens=32,
                          max_prefill_seqs_per_step=2, prefill_token_budget=32,
                          overlap_prefill_decode=overlap)
    runner = ModelRunner(config)
    peak = profile_peak_bytes(runner, runner.model.kv_cache_spec())
    decode = max(s.num_tokens for s in ran if not s.is_prefill)
    prefill = max(s.num_tokens for s in ran if s.is_prefill)
    assert len(ran) == 2  # the largest decode step and the largest prefill step, once each
    steps = decode + prefill if overlap else max(decode, prefill)
    assert peak == 1000 * steps + processing_bytes  # no graphs on the CPU
