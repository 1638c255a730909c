"""A finding, not a guarantee corun makes: whether a decoding row's bits depend on corun's
fixed decode batch size B. corun runs every decode step at one B, so a row never meets another B;
if its bits were the same at every B, corun could capture several decode sizes and step at the
smallest that holds the live rows (the peers step only the live rows, and on an H100 corun's TPOT
at 1 req/s was 26% above `default`'s: experiments/README.md's serving-load section).

On the CPU engine (Triton interpreter, fp32, tiny models) B = 4 and 32 keep every bit: at these
widths the GEMM policy never splits K, and every other kernel's arithmetic is the row's own.
Natively it does not hold as shipped: at Qwen3-0.6B's shapes the corun GEMM splits K at M 8 and
not at M 64, and requests decoded at B = 8 differed from B = 64 (an H100, 2026-12-05:
experiments/results/native-tests-h100.json; tests/engine/test_gpu_engine.py, which also holds
the check with one GEMM config across the sizes).
"""

from __future__ import annotations

import os

import pytest

from corun.config import EngineConfig
from corun.engine import LLMEngine
from corun.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="the CPU engine on the Triton interpreter; natively the same check is "
           "tests/engine/test_gpu_engine.py's")
BASE = dict(backend="triton", device="cpu", dtype="float32", max_model_len=96, block_size=8,
            mode="corun", prefill_chunk_size=16, prefill_step_tokens=32,
            max_prefill_seqs_per_step=4, prefill_token_budget=32)
PROMPTS = [[17, 3, 250, 9, 81, 44, 5, 128, 66, 7, 200, 31], [5] * 30, [9, 8, 7]]


def _fingerprints(model: str, decode_batch_size: int) -> dict[str, str]:
    config = EngineConfig(model=model, max_num_seqs=decode_batch_size,
                          decode_batch_size=decode_batch_size, **BASE)
    engine = LLMEngine(config)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(prompt, SamplingParams(max_tokens=4 + i, temperature=0.8, seed=i),
                           f"r{i}")
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.fingerprint
    engine.close()
    return finals


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-qwen3-moe", "tiny-deepseek-v3"])
def test_corun_rows_keep_their_bits_across_the_decode_batch_size(model):
    """The same requests decoded at B = 4 and B = 32 (the GEMMs' M buckets 8 and 32): every
    request's fingerprint (its tokens and the bits of the logits behind them) is the same."""
    small, large = _fingerprints(model, 4), _fingerprints(model, 32)
    assert len(small) == len(PROMPTS) and small == large


@pytest.mark.slow
def test_a_gemm_policy_whose_block_k_follows_m_breaks_it_negative_control(monkeypatch):
    """Under the interpreter BLOCK_K changes a row's bits (on the H200 it does not: DESIGN.md);
    a policy that picks it from M, as test_engine_triton's negative control does, makes B = 4
    and B = 32 differ: the check above can fail."""
    import kernels.gemm as gemm_module
    from invariance_tests.test_engine_triton import _bk_by_m

    monkeypatch.setattr(gemm_module, "gemm_config", _bk_by_m)
    assert _fingerprints("tiny-qwen3", 4) != _fingerprints("tiny-qwen3", 32)
