"""DeepSeek-V3 (``DeepseekV3ForCausalLM``): MLA attention (absorbed decode), the first
``first_k_dense_replace`` layers with a dense SwiGLU MLP, the rest with grouped sigmoid routing
over routed experts plus shared experts. Layers >= num_hidden_layers in a checkpoint (the MTP
layer 61) are skipped by the loader.

Invariances are those of ``models.ops`` under the step's OpsConfig; the latent cache row of a
token depends on that token only, and decode attention splits at the fixed decode split size.
"""

from __future__ import annotations

from torch import nn

from models.config import ModelConfig
from models.forward_batch import KVCacheSpec
from models.layers.decoder import CausalLM, DecoderLayer
from models.layers.mla import MLAAttention, mla_rotary
from models.layers.mlp import GatedMLP
from models.layers.moe import GroupedTopKMoE
from models.parallel import SINGLE, ParallelContext


class DeepseekV3ForCausalLM(CausalLM):
    # Only gate/up are fused; q_a_proj, q_b_proj, kv_a_proj_with_mqa stay separate modules.
    packed_modules_mapping = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    supports_prefill_graphs = False  # MLA's prefill expands each context by its host length

    def __init__(self, config: ModelConfig, parallel: ParallelContext = SINGLE) -> None:
        rotary = mla_rotary(config)  # one table, shared by every layer
        layers = []
        for i in range(config.num_hidden_layers):
            is_moe = config.is_moe_layer(i)
            mlp: nn.Module = (GroupedTopKMoE(config, parallel) if is_moe
                              else GatedMLP(config.hidden_size, config.intermediate_size, parallel))
            attention = MLAAttention(config, i, parallel, rotary)
            layers.append(DecoderLayer(config, attention, mlp, is_moe))
        super().__init__(config, layers, parallel)

    def kv_cache_spec(self) -> KVCacheSpec:
        """The latent cache is replicated: the same entry width on every rank."""
        c = self.config
        return KVCacheSpec(kind="mla", num_layers=c.num_hidden_layers,
                           entry_dim=c.kv_lora_rank + c.qk_rope_head_dim)

    def process_weights_after_loading(self) -> None:
        """Split each layer's kv_b_proj into W_UK / W_UV for the absorbed decode."""
        for layer in self.model.layers:
            layer.self_attn.split_kv_b_proj()
