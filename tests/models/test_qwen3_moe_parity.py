"""Qwen3-MoE vs transformers on the CPU in fp32 with the torch backend (eager attention and
experts), for both checkpoint layouts: Hub per-expert keys and v5 fused expert tensors."""

from __future__ import annotations

import pytest
import torch

from kernels.mode import Mode
from models.forward_batch import OpsConfig
from models.loader import load_model
from tests.models.helpers import relative_error, run_hf_sequence, run_sequence

TOLERANCE = 1e-4


def make_hf_qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[0], max_position_embeddings=128, rope_theta=10000.0,
        initializer_range=0.2, attn_implementation="eager", experts_implementation="eager")
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(config).eval()


@pytest.mark.parametrize("original_format", [True, False], ids=["per-expert", "fused-v5"])
def test_qwen3_moe_matches_transformers(tmp_path, original_format):
    hf_model = make_hf_qwen3_moe()
    path = tmp_path / "ckpt"
    hf_model.save_pretrained(path, save_original_format=original_format)
    model, config = load_model(path, dtype=torch.float32, device="cpu")
    assert [config.is_moe_layer(i) for i in range(2)] == [False, True]
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, 256, (9,), generator=gen)
    decode_ids = torch.randint(0, 256, (3,), generator=gen)
    ours = run_sequence(model, prompt, decode_ids, OpsConfig(mode=Mode.CORUN, backend="torch"))
    ref = run_hf_sequence(hf_model, prompt, decode_ids)
    err = relative_error(ours, ref)
    assert err <= TOLERANCE, f"max|diff|/max|ref| = {err:.3g} > {TOLERANCE}"
