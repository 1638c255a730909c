"""ModelConfig.from_hf (both RoPE forms, Hy3's Hub / legacy / v5 files, validation), the
named-config table against published parameter counts, and build_model's seeded random
weights."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels.mode import Mode
from models import build_model
from models.config import NAMED_CONFIGS, ModelConfig, num_parameters
from models.forward_batch import OpsConfig
from tests.models.helpers import run_sequence

HUB_DEEPSEEK = {
    "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 129280, "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
    "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
    "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
    "moe_layer_freq": 1, "norm_topk_prob": True, "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6, "rope_theta": 10000, "bos_token_id": 0, "eos_token_id": 1,
    "tie_word_embeddings": False,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
}


def test_from_hf_reads_hub_and_v5_rope_forms_alike():
    v5 = {k: v for k, v in HUB_DEEPSEEK.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40,
                             "original_max_position_embeddings": 4096, "beta_fast": 32,
                             "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    hub, new = ModelConfig.from_hf(HUB_DEEPSEEK), ModelConfig.from_hf(v5)
    assert hub == new == NAMED_CONFIGS["deepseek-v3"]
    assert hub.rope_scaling["rope_type"] == "yarn" and hub.qk_head_dim == 192


# The official Hy3-preview config.json's fields (no mlp_layer_types, first_k_dense_replace 1) and
# a few it carries that transformers ignores.
HUB_HY3 = {
    "architectures": ["HYV3ForCausalLM"], "vocab_size": 120832, "hidden_size": 4096,
    "intermediate_size": 13312, "moe_intermediate_size": 1536, "num_hidden_layers": 80,
    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128, "num_experts": 192,
    "num_experts_per_tok": 8, "num_shared_experts": 1, "router_scaling_factor": 2.826,
    "first_k_dense_replace": 1, "enable_moe_fp32_combine": True, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 262144, "tie_word_embeddings": False, "eos_token_id": 120025,
    "rope_parameters": {"rope_theta": 11158840.0, "rope_type": "default"},
    "moe_router_use_sigmoid": True, "route_norm": True, "num_nextn_predict_layers": 1,
}


def test_from_hf_reads_hy3_hub_legacy_and_v5_forms_alike():
    legacy = {k: v for k, v in HUB_HY3.items() if k not in ("rope_parameters",
                                                            "moe_intermediate_size")}
    legacy.update(rope_theta=11158840.0, expert_hidden_dim=1536)
    v5 = dict(HUB_HY3, mlp_layer_types=["dense"] + ["sparse"] * 79)
    del v5["first_k_dense_replace"]
    parsed = [ModelConfig.from_hf(c) for c in (HUB_HY3, legacy, v5)]
    assert parsed[0] == parsed[1] == parsed[2] == NAMED_CONFIGS["hy3"]
    assert parsed[0].rope_scaling is None and parsed[0].n_group == 1
    # transformers' HYV3Config defaults where the file is silent
    bare = {k: v for k, v in HUB_HY3.items()
            if k not in ("rope_parameters", "enable_moe_fp32_combine", "first_k_dense_replace",
                         "num_shared_experts", "router_scaling_factor", "rms_norm_eps")}
    assert ModelConfig.from_hf(bare) == NAMED_CONFIGS["hy3"]
    off = ModelConfig.from_hf(dict(HUB_HY3, enable_moe_fp32_combine=False, first_k_dense_replace=2))
    assert not off.enable_moe_fp32_combine and [off.is_moe_layer(i) for i in range(3)] == [
        False, False, True]
    with pytest.raises(ValueError, match="mlp_bias"):
        ModelConfig.from_hf(dict(HUB_HY3, mlp_bias=True))
    with pytest.raises(ValueError, match="mlp_layer_types: 79 entries for 80 layers"):
        ModelConfig.from_hf(dict(v5, mlp_layer_types=["dense"] * 79))
    with pytest.raises(ValueError, match="mlp_layer_types: required"):
        dataclasses.replace(NAMED_CONFIGS["tiny-hy3"], mlp_layer_types=())


def test_from_hf_plain_rope_is_none():
    config = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 10, "hidden_size": 8,
              "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
              "num_key_value_heads": 1, "head_dim": 4, "max_position_embeddings": 32,
              "rope_parameters": {"rope_type": "default", "rope_theta": 5e6},
              "eos_token_id": [3, 4]}
    parsed = ModelConfig.from_hf(config)
    assert parsed.rope_scaling is None and parsed.rope_theta == 5e6
    assert parsed.eos_token_id == (3, 4)


@pytest.mark.parametrize("field, value, message", [
    ("architecture", "LlamaForCausalLM", "architecture: unsupported"),
    ("num_key_value_heads", 3, "num_key_value_heads: 3 does not divide"),
    ("hidden_size", 0, "hidden_size: expected >= 1"),
    ("mlp_layer_types", ("dense", "moe"), "mlp_layer_types: expected entries"),
])
def test_invalid_config_names_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(NAMED_CONFIGS["tiny-qwen3"], **{field: value})


@pytest.mark.parametrize("name, billions", [
    ("qwen3-0.6b", 0.6), ("qwen3-8b", 8.2), ("qwen3-30b-a3b", 30.5),
    ("qwen3-235b-a22b", 235.1), ("deepseek-v3", 671.0), ("hy3", 295.0),
])
def test_real_shapes_match_published_parameter_counts(name, billions):
    assert round(num_parameters(NAMED_CONFIGS[name]) / 1e9, 1) == billions


def test_truncated_configs_fit_one_h200_in_bf16():
    for name in ("qwen3-235b-a22b-l12", "deepseek-v3-l6", "hy3-l14"):
        assert 2 * num_parameters(NAMED_CONFIGS[name]) < 100e9, name
    truncated = NAMED_CONFIGS["hy3-l14"]
    assert truncated.mlp_layer_types == ("dense",) + ("sparse",) * 13


def test_build_model_is_seeded():
    a, _ = build_model("tiny-qwen3-moe", dtype=torch.float32, device="cpu", seed=1)
    b, _ = build_model("tiny-qwen3-moe", dtype=torch.float32, device="cpu", seed=1)
    c, _ = build_model("tiny-qwen3-moe", dtype=torch.float32, device="cpu", seed=2)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


def test_corun_default_random_logits_are_finite_and_varied_in_bf16():
    model, config = build_model("corun-default", dtype=torch.bfloat16, device="cpu", seed=0)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied
    prompt = torch.arange(12) * 7 % 256
    logits = run_sequence(model, prompt, torch.tensor([258, 65]),
                          OpsConfig(Mode.CORUN, backend="torch"))
    for step in logits:
        assert torch.isfinite(step).all()
        assert step.std(dim=-1).min() > 0.1  # not flat
    assert len(set(logits[0].argmax(-1).tolist())) > 3  # next-token choice varies with position


@pytest.mark.parametrize("extra, message", [
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
     "quantization_config: fp8 checkpoints are not supported"),
    ({"use_sliding_window": True, "sliding_window": 4096}, "use_sliding_window: "),
    ({"hidden_act": "gelu"}, "hidden_act: 'gelu' is not supported"),
])
def test_from_hf_refuses_what_the_models_do_not_build(extra, message):
    """A config the models would load and then compute differently from (found against
    transformers: a sliding window gave a relative error of 1.46, GELU 0.21)."""
    assert ModelConfig.from_hf({**HUB_DEEPSEEK, "use_sliding_window": False, "hidden_act": "silu"})
    with pytest.raises(ValueError, match=f"^{message}"):
        ModelConfig.from_hf({**HUB_DEEPSEEK, **extra})


def test_from_hf_takes_transformers_defaults_for_missing_keys():
    keys = ("n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor",
            "first_k_dense_replace", "n_shared_experts")
    sparse = ModelConfig.from_hf({k: v for k, v in HUB_DEEPSEEK.items() if k not in keys})
    # DeepseekV3Config's defaults, which are also DeepSeek-V3's own values.
    assert sparse == NAMED_CONFIGS["deepseek-v3"]
    qwen3 = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 64, "hidden_size": 64,
             "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
             "max_position_embeddings": 32}
    assert ModelConfig.from_hf(qwen3).head_dim == 128  # Qwen3Config's, not hidden / heads


def test_max_sequence_length_follows_yarn_and_bounds_max_model_len():
    qwen3_8b = NAMED_CONFIGS["qwen3-8b"]
    assert qwen3_8b.max_sequence_length == 40960
    # Qwen3's documented YaRN opt-in keeps max_position_embeddings and serves 4 x 32768.
    yarn = dataclasses.replace(qwen3_8b, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})
    assert yarn.max_sequence_length == 131072
    assert NAMED_CONFIGS["deepseek-v3"].max_sequence_length == 163840
    from corun.config import EngineConfig
    from corun.model_runner import check_model_len
    check_model_len(EngineConfig(max_model_len=131072), yarn)
    with pytest.raises(ValueError, match="^max_model_len: 131072 exceeds the 40960 positions"):
        check_model_len(EngineConfig(max_model_len=131072), qwen3_8b)


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-deepseek-v3"])
def test_layers_share_one_rope_table_of_every_served_position(name):
    from models.layers.rotary import RotaryEmbedding

    model, config = build_model(name, dtype=torch.float32, device="cpu", seed=0)
    tables = {id(m): m for m in model.modules() if isinstance(m, RotaryEmbedding)}
    assert len(tables) == 1  # not one a layer (80 x 128 MiB for Hy3)
    table = next(iter(tables.values())).cos_sin_cache
    assert table.shape[0] == config.max_sequence_length
    assert [n for n, _ in model.named_buffers() if n.endswith("cos_sin_cache")] == [
        "model.layers.0.self_attn.rotary_emb.cos_sin_cache"]
