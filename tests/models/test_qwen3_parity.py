"""Qwen3 dense vs transformers on the CPU in fp32 with the torch backend: a HF model with random
weights is saved, loaded by our loader, and run on the same ids (prompt, then decode steps)."""

from __future__ import annotations

import pytest
import torch

from kernels.mode import Mode
from models.forward_batch import OpsConfig
from models.loader import load_model
from tests.models.helpers import (
    randomize_biases,
    relative_error,
    run_hf_sequence,
    run_sequence,
    save_hf,
)

TOLERANCE = 1e-4


def make_hf_qwen3(tie: bool, attention_bias: bool = False):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
        rope_theta=10000.0, tie_word_embeddings=tie, initializer_range=0.2,
        attention_bias=attention_bias, attn_implementation="eager")
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).eval()
    randomize_biases(model)
    return model


@pytest.mark.parametrize(("tie", "attention_bias"), [(False, False), (True, False), (False, True)],
                         ids=["untied", "tied", "attention-bias"])
def test_qwen3_matches_transformers(tmp_path, tie, attention_bias):
    hf_model = make_hf_qwen3(tie, attention_bias)
    model, config = load_model(save_hf(hf_model, tmp_path), dtype=torch.float32, device="cpu")
    assert config.tie_word_embeddings == tie and config.attention_bias == attention_bias
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 256, (11,), generator=gen)
    decode_ids = torch.randint(0, 256, (4,), generator=gen)
    ours = run_sequence(model, prompt, decode_ids, OpsConfig(mode=Mode.CORUN, backend="torch"))
    ref = run_hf_sequence(hf_model, prompt, decode_ids)
    err = relative_error(ours, ref)
    assert err <= TOLERANCE, f"max|diff|/max|ref| = {err:.3g} > {TOLERANCE}"
