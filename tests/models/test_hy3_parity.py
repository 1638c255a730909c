"""Hy3 vs transformers' HYV3ForCausalLM on the CPU in fp32 with the torch backend (eager attention
and experts): prompt logits and decode steps over its DynamicCache, from both checkpoint layouts
(the Hub's per-expert keys with ``mlp.router.gate`` / ``mlp.expert_bias`` / ``mlp.shared_mlp``,
and v5's fused experts with ``mlp.gate`` / ``mlp.e_score_correction_bias`` /
``mlp.shared_experts``). The tiny config covers a non-default ``mlp_layer_types``, a shared
expert, a correction bias with both signs that changes the routing, and the MTP-layer skip.

The negative control shows the comparison catches a wrong router: with the correction bias
zeroed, or the router scale at 1, the same logits miss the tolerance. (The fp32 combine cannot be
caught here: in fp32 it is the plain add, and in bf16 torch's add rounds the same way.)
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels.mode import Mode
from models import ops
from models.forward_batch import OpsConfig
from models.loader import CheckpointError, load_model
from tests.models.helpers import relative_error, run_hf_sequence, run_sequence
from tests.models.test_deepseek_v3_parity import add_mtp_layer

TOLERANCE = 1e-4
LAYER_TYPES = ["dense", "sparse", "dense", "sparse"]
TORCH_OPS = OpsConfig(mode=Mode.CORUN, backend="torch")


def make_hf_hy3():
    from transformers import HYV3Config, HYV3ForCausalLM

    config = HYV3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=len(LAYER_TYPES), mlp_layer_types=LAYER_TYPES, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        num_shared_experts=1, router_scaling_factor=2.826, enable_moe_fp32_combine=True,
        max_position_embeddings=128, initializer_range=0.2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        attn_implementation="eager", experts_implementation="eager")
    torch.manual_seed(0)
    model = HYV3ForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in model.model.layers:
            if LAYER_TYPES[layer.self_attn.layer_idx] == "sparse":
                bias = layer.mlp.e_score_correction_bias  # HF keeps it on the MoE block
                bias.copy_(torch.randn(bias.shape, generator=gen) * 0.1)
    return model


@pytest.fixture(scope="module")
def hf_model():
    return make_hf_hy3()


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    return torch.randint(0, 256, (9,), generator=gen), torch.randint(0, 256, (3,), generator=gen)


@pytest.fixture(scope="module")
def hf_logits(hf_model):
    return run_hf_sequence(hf_model, *_inputs())


def _load(hf_model, path, original_format: bool):
    hf_model.save_pretrained(path, save_original_format=original_format)
    add_mtp_layer(path, len(LAYER_TYPES))
    return load_model(path, dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("original_format", [True, False], ids=["hub-per-expert", "fused-v5"])
def test_hy3_matches_transformers(tmp_path, hf_model, hf_logits, original_format):
    model, config = _load(hf_model, tmp_path / "ckpt", original_format)
    assert config.architecture == "HYV3ForCausalLM" and config.enable_moe_fp32_combine
    assert [config.is_moe_layer(i) for i in range(len(LAYER_TYPES))] == [
        t == "sparse" for t in LAYER_TYPES]
    assert (config.n_group, config.n_shared_experts, config.routed_scaling_factor) == (1, 1, 2.826)
    bias = model.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.dtype == torch.float32 and torch.equal(
        bias, hf_model.model.layers[1].mlp.e_score_correction_bias)
    err = relative_error(run_sequence(model, *_inputs(), TORCH_OPS), hf_logits)
    print(f"max|diff|/max|ref| = {err:.3g}")
    assert err <= TOLERANCE, f"max|diff|/max|ref| = {err:.3g} > {TOLERANCE}"


def test_wrong_router_semantics_miss_the_tolerance(tmp_path, hf_model, hf_logits):
    """Negative control: zeroed correction bias, then router_scaling_factor 1, each fails."""
    model, config = _load(hf_model, tmp_path / "ckpt", original_format=False)
    moe_blocks = [layer.mlp for layer in model.model.layers if layer.is_moe]
    saved = [block.gate.e_score_correction_bias.clone() for block in moe_blocks]
    for block in moe_blocks:
        block.gate.e_score_correction_bias.zero_()
    err = relative_error(run_sequence(model, *_inputs(), TORCH_OPS), hf_logits)
    print(f"zeroed bias: {err:.3g}")
    assert err > TOLERANCE, f"zeroed bias still within tolerance ({err:.3g})"
    for block, bias in zip(moe_blocks, saved, strict=True):
        block.gate.e_score_correction_bias.copy_(bias)
        block.config = dataclasses.replace(config, routed_scaling_factor=1.0)
    err = relative_error(run_sequence(model, *_inputs(), TORCH_OPS), hf_logits)
    print(f"router scale 1: {err:.3g}")
    assert err > TOLERANCE, f"router scale 1 still within tolerance ({err:.3g})"


def test_both_names_of_one_tensor_are_rejected(tmp_path, hf_model):
    """A Hub checkpoint that also holds the v5 name of a renamed tensor raises, naming both."""
    from safetensors.torch import load_file, save_file

    path = tmp_path / "ckpt"
    hf_model.save_pretrained(path, save_original_format=True)
    tensors = load_file(path / "model.safetensors")
    bias = tensors["model.layers.1.mlp.expert_bias"]
    tensors["model.layers.1.mlp.e_score_correction_bias"] = bias.clone()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="expert_bias.*e_score_correction_bias|"
                                              "e_score_correction_bias.*expert_bias"):
        load_model(path, dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_one_group_grouped_topk_is_the_hy3_router(backend):
    """At the real 192 experts, top-8: grouped_topk with n_group = topk_group = 1 picks HF
    HYV3TopKRouter's experts (HF returns them unsorted) with its weights."""
    from transformers import HYV3Config
    from transformers.models.hy_v3.modeling_hy_v3 import HYV3TopKRouter

    config = HYV3Config(hidden_size=64, num_hidden_layers=2)
    router = HYV3TopKRouter(config)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        router.weight.copy_(torch.randn(192, 64, generator=gen) * 0.3)
    bias = torch.randn(192, generator=gen) * 0.1
    x = torch.randn(5, 64, generator=gen)
    with torch.no_grad():
        logits, hf_weights, hf_ids = router(x, bias)
    weights, ids = ops.grouped_topk(logits, bias, 8, 1, 1, True, config.router_scaling_factor,
                                    OpsConfig(mode=Mode.CORUN, backend=backend))
    hf_order, order = hf_ids.argsort(dim=-1), ids.long().argsort(dim=-1)
    assert torch.equal(ids.long().gather(1, order), hf_ids.gather(1, hf_order))
    torch.testing.assert_close(weights.gather(1, order), hf_weights.gather(1, hf_order),
                               rtol=1e-6, atol=1e-6)
