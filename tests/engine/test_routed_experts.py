"""Routing replay (``EngineConfig.enable_return_routed_experts``): each finished sample carries
the experts every MoE layer routed each token the model read to, kept per KV slot, so prefix-cache
hits, sibling samples and preempted (swapped) sequences carry them too; they are exactly the
routing the trainer forward computes for the same tokens (``Policy.routed_experts``), and the
server returns them per choice."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from corun import LLM, SamplingParams
from corun.training import Policy

BASE = dict(dtype="float32", device="cpu", backend="torch", max_num_seqs=4, max_model_len=96,
            block_size=4, prefill_chunk_size=8, max_num_batched_tokens=16,
            prefill_step_tokens=16, max_prefill_seqs_per_step=4, prefill_token_budget=16)
SHARED = [7, 8, 9, 10, 11, 12, 13, 14]
PROMPTS = [SHARED + [20, 21, 22, 23, 24], SHARED + [30, 31], [40] * 19]


def _check(model: str, mode: str, max_tokens: int = 6, **config) -> int:
    """Generate with routing recorded, compare every sample's with the trainer's; returns the
    engine's preemption count."""
    kw = dict(BASE, **config)
    with LLM(model, mode=mode, skip_tokenizer_init=True, enable_return_routed_experts=True,
             **kw) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(max_tokens=max_tokens, n=2, seed=5, temperature=1.0,
                                           ignore_eos=True), use_tqdm=False)
        preempted = llm.engine.scheduler.num_preemptions
    policy = Policy(model, mode=mode, **kw)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        for sample in out.outputs:
            read = prompt + sample.token_ids
            routed = sample.routed_experts
            c = policy.model_config
            num_moe = sum(c.is_moe_layer(i) for i in range(c.num_hidden_layers))
            assert routed.shape == (len(read) - 1, num_moe, c.num_experts_per_tok)
            expected = policy.routed_experts([read])[0][:-1]
            np.testing.assert_array_equal(routed, expected)
    return preempted


@pytest.mark.parametrize("model, mode", [("tiny-qwen3-moe", "corun"),
                                         ("tiny-deepseek-v3", "batch_invariant"),
                                         ("tiny-hy3", "batch_invariant_tuned")])
def test_routed_experts_are_the_trainers_routing(model, mode):
    """Shared prefixes (cache hits) and n = 2 (a sibling's prompt) included."""
    _check(model, mode)


def test_a_preempted_sequence_keeps_its_routing():
    preempted = _check("tiny-qwen3-moe", "corun", max_tokens=20, max_model_len=64,
                       num_kv_blocks=16)
    assert preempted > 0, "the tight KV pool preempted nothing"


def test_the_triton_kernels_route_as_the_trainer():
    _check("tiny-qwen3-moe", "corun", backend="triton", block_size=8)


def test_off_by_default_and_refused_for_a_dense_model():
    with LLM("tiny-qwen3-moe", skip_tokenizer_init=True, **BASE) as llm:
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert out.outputs[0].routed_experts is None
    with pytest.raises(ValueError, match="enable_return_routed_experts: tiny-qwen3 has no MoE"):
        LLM("tiny-qwen3", skip_tokenizer_init=True, enable_return_routed_experts=True, **BASE)


def test_the_server_returns_them_per_choice():
    from tests.api.inprocess import build_engine, serve_in_thread

    engine, tokenizer = build_engine("--model", "tiny-qwen3-moe", "--device", "cpu",
                                     "--enable-return-routed-experts")
    with serve_in_thread(engine, tokenizer) as url:
        body = httpx.post(f"{url}/v1/completions", json={
            "prompt": [5, 6, 7], "max_tokens": 4, "seed": 1, "ignore_eos": True},
            timeout=60).json()
    routed = body["choices"][0]["routed_experts"]
    assert np.asarray(routed).shape == (3 + 4 - 1, 1, 2)
