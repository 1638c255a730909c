"""Hy3 (Tencent Hy3-preview, transformers ``HYV3ForCausalLM``): Qwen3's attention (GQA, per-head
q/k RMSNorm before NeoX RoPE, theta 11158840 by default), and per ``mlp_layer_types`` either a
dense SwiGLU MLP (layer 0 in the real model) or the sigmoid-routed MoE with one shared expert.

The MoE is ``GroupedTopKMoE`` with one group: transformers' HYV3TopKRouter takes fp32 logits,
``s = sigmoid(logits)``, the top-k of ``s + e_score_correction_bias`` (the bias steers the choice
only), the unbiased ``s`` of those experts renormalised (``/ (sum + 1e-20)``, always) and times
``router_scaling_factor`` (2.826); the shared expert is added in fp32 when
``enable_moe_fp32_combine``. No expert groups, no first-k-dense key (``mlp_layer_types`` says
which layers are dense), no MLP or attention biases in the real model, untied embeddings.

Checkpoint names: transformers v5 saves ``mlp.gate.weight``, ``mlp.e_score_correction_bias`` (a
buffer of the MoE block, not of the gate as in DeepSeek-V3), ``mlp.shared_experts.*`` and fused
``mlp.experts.gate_up_proj`` / ``down_proj``; the Hub files (and ``save_original_format``) name
them ``mlp.router.gate.weight``, ``mlp.expert_bias``, ``mlp.shared_mlp.*`` and per-expert
``mlp.experts.{e}.{gate,up,down}_proj.weight``. ``HY3_CHECKPOINT_RENAMES`` maps both onto the
shared layer's names (the bias lives on the router there); the MTP layer 80 is skipped by the
loader.

Invariances are those of ``models.ops`` under the step's OpsConfig: the router is per token, and
the expert GEMMs are expert-count-independent under corun / batch_invariant.
"""

from __future__ import annotations

from torch import nn

from models.config import ModelConfig
from models.forward_batch import KVCacheSpec
from models.layers.attention import GQAAttention, gqa_rotary
from models.layers.decoder import CausalLM, DecoderLayer
from models.layers.mlp import GatedMLP
from models.layers.moe import GroupedTopKMoE
from models.parallel import SINGLE, ParallelContext
from models.qwen3 import QWEN3_PACKED_MODULES, mha_cache_spec

# transformers' conversion_mapping for hy_v3 (Hub -> v5), plus v5's block-level bias onto the
# router that holds it here.
HY3_CHECKPOINT_RENAMES = {
    "mlp.router.gate": "mlp.gate",
    "mlp.expert_bias": "mlp.gate.e_score_correction_bias",
    "mlp.e_score_correction_bias": "mlp.gate.e_score_correction_bias",
    "mlp.shared_mlp": "mlp.shared_experts",
}


class HYV3ForCausalLM(CausalLM):
    packed_modules_mapping = QWEN3_PACKED_MODULES
    checkpoint_renames = HY3_CHECKPOINT_RENAMES

    def __init__(self, config: ModelConfig, parallel: ParallelContext = SINGLE) -> None:
        rotary = gqa_rotary(config)  # one table, shared by every layer
        layers = []
        for i in range(config.num_hidden_layers):
            is_moe = config.is_moe_layer(i)
            mlp: nn.Module = (GroupedTopKMoE(config, parallel) if is_moe
                              else GatedMLP(config.hidden_size, config.intermediate_size, parallel))
            attention = GQAAttention(config, i, parallel, rotary)
            layers.append(DecoderLayer(config, attention, mlp, is_moe))
        super().__init__(config, layers, parallel)

    def kv_cache_spec(self) -> KVCacheSpec:
        return mha_cache_spec(self.config, self.parallel)
