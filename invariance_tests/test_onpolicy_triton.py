"""Zero train-generation mismatch on the Triton kernels (through the interpreter): decode
attention at its splits, prefill attention folding the same splits, batch-invariant GEMMs; and
the negative controls only the kernels can show (a prefill at another split size, a decode GEMM
that splits K). The scenarios and checks are ``test_onpolicy``'s, on small pinned workloads."""

from __future__ import annotations

import dataclasses

import pytest

from invariance_tests.test_onpolicy import BASE, NONE, SMALL, _config, _mismatches


@pytest.mark.slow
@pytest.mark.parametrize("family, mode", [("tiny-qwen3", "corun"),
                                          ("tiny-deepseek-v3", "batch_invariant_tuned")])
def test_triton_kernels_keep_the_bits_on_every_path(family, mode):
    """The Triton kernels (decode attention at its splits, prefill attention folding the same
    splits, batch-invariant GEMMs) through the interpreter, on a small pinned workload."""
    assert _mismatches(_config(family, mode, SMALL, backend="triton"), SMALL) == NONE


@pytest.mark.slow
def test_prefill_attention_at_another_split_size_differs_negative_control(monkeypatch):
    """Prefill attention folding each row's keys in splits of twice the decode's: every row
    longer than a decode split gets other bits than its decode."""
    from models.forward_batch import OpsConfig

    monkeypatch.setattr(OpsConfig, "prefill_split_size",
                        property(lambda self: 2 * self.decode_split_size))
    w = dataclasses.replace(SMALL, prompt_lens=(13,))
    counts = _mismatches(_config("tiny-qwen3", "batch_invariant", w, backend="triton"), w)
    assert counts["scored"] > 0 and counts["trainer"] > 0


@pytest.mark.slow
def test_split_k_decode_gemm_differs_negative_control(monkeypatch):
    """A GEMM policy that splits K at a decode's M (what corun's own policy may pick on a GPU):
    the decode rows' bits are not the prefill rows'."""
    from kernels import gemm as gemm_module

    policy = gemm_module._m_dependent_config

    def split_small_m(table, portable, m, n, k, dtype, mode):
        config = policy(table, portable, m, n, k, dtype, mode)
        if m <= BASE["max_num_seqs"] and k >= 2 * config.block_k:
            return dataclasses.replace(config, split_k=2)
        return config

    monkeypatch.setattr(gemm_module, "_m_dependent_config", split_small_m)
    gemm_module._gemm_config.cache_clear()
    try:
        counts = _mismatches(
            _config("tiny-qwen3", "batch_invariant_tuned", SMALL, backend="triton"), SMALL)
    finally:
        gemm_module._gemm_config.cache_clear()
    # The logits rows differ (the fingerprints hash every logit); on this small workload the
    # sampled tokens' own logprobs may round alike.
    assert counts["fingerprint"] > 0 and counts["top"] > 0
