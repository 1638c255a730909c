"""DeepSeek-V3 vs transformers on the CPU in fp32 with the torch backend. The tiny config covers
group-limited routing, shared experts, a dense first layer, YaRN with interleaved RoPE (and NeoX
RoPE, rope_interleave false), q LoRA and plain q_proj, a positive e_score_correction_bias (HF
masks dropped groups with 0, we with -inf: they agree while biased scores are positive), and the
MTP-layer skip in the loader."""

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
)

TOLERANCE = 1e-4


def make_hf_deepseek_v3(q_lora_rank: int | None, rope_interleave: bool = True,
                        attention_bias: bool = False):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=q_lora_rank,
        qk_rope_head_dim=16, v_head_dim=16, qk_nope_head_dim=16, n_group=4, topk_group=2,
        num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=True,
        max_position_embeddings=512, rope_interleave=rope_interleave, initializer_range=0.2,
        attention_bias=attention_bias,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 128, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        attn_implementation="eager", experts_implementation="eager")
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            bias = layer.mlp.gate.e_score_correction_bias
            bias.copy_(torch.rand(bias.shape, generator=gen) * 0.2)
    randomize_biases(model)
    return model


def add_mtp_layer(path, num_layers: int) -> None:
    """Append keys of an extra layer, as the real checkpoint's MTP layer 61, to the shard."""
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    tensors = load_file(file)
    tensors[f"model.layers.{num_layers}.enorm.weight"] = torch.ones(64)
    tensors[f"model.layers.{num_layers}.eh_proj.weight"] = torch.ones(64, 128)
    save_file(tensors, file, metadata={"format": "pt"})


@pytest.mark.parametrize(("q_lora_rank", "rope_interleave", "attention_bias"),
                         [(32, True, False), (None, True, False), (32, False, False),
                          (32, True, True)],
                         ids=["q-lora", "q-proj", "q-lora-neox-rope", "q-lora-attention-bias"])
def test_deepseek_v3_matches_transformers(tmp_path, q_lora_rank, rope_interleave,
                                          attention_bias):
    hf_model = make_hf_deepseek_v3(q_lora_rank, rope_interleave, attention_bias)
    path = tmp_path / "ckpt"
    hf_model.save_pretrained(path)
    add_mtp_layer(path, 3)
    model, config = load_model(path, dtype=torch.float32, device="cpu")
    assert [config.is_moe_layer(i) for i in range(3)] == [False, True, True]
    assert config.rope_scaling["rope_type"] == "yarn"
    assert config.rope_interleave is rope_interleave
    gen = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, 256, (10,), generator=gen)
    decode_ids = torch.randint(0, 256, (3,), generator=gen)
    ours = run_sequence(model, prompt, decode_ids, OpsConfig(mode=Mode.CORUN, backend="torch"))
    ref = run_hf_sequence(hf_model, prompt, decode_ids)
    err = relative_error(ours, ref)
    assert err <= TOLERANCE, f"max|diff|/max|ref| = {err:.3g} > {TOLERANCE}"
