"""Qwen3 dense (``Qwen3ForCausalLM``): GQA with per-head q/k RMSNorm, NeoX RoPE, SwiGLU MLP,
tied or untied embeddings. Invariances are those of ``models.ops`` under the step's OpsConfig."""

from __future__ import annotations

from models.config import ModelConfig
from models.forward_batch import KVCacheSpec
from models.layers.attention import GQAAttention, gqa_rotary, kv_head_range
from models.layers.decoder import CausalLM, DecoderLayer
from models.layers.mlp import GatedMLP
from models.parallel import SINGLE, ParallelContext

# q/k/v and gate/up are fused into one GEMM each; the loader writes HF shards into their rows.
QWEN3_PACKED_MODULES = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


def mha_cache_spec(config: ModelConfig, parallel: ParallelContext = SINGLE) -> KVCacheSpec:
    """Per rank: the kv heads this rank holds (all of them at TP=1)."""
    start, stop = kv_head_range(config.num_attention_heads, config.num_key_value_heads, parallel)
    return KVCacheSpec(kind="mha", num_layers=config.num_hidden_layers,
                       num_kv_heads=stop - start, head_dim=config.head_dim)


class Qwen3ForCausalLM(CausalLM):
    packed_modules_mapping = QWEN3_PACKED_MODULES

    def __init__(self, config: ModelConfig, parallel: ParallelContext = SINGLE) -> None:
        rotary = gqa_rotary(config)  # one table, shared by every layer
        layers = [
            DecoderLayer(config, GQAAttention(config, i, parallel, rotary),
                         GatedMLP(config.hidden_size, config.intermediate_size, parallel),
                         is_moe=False)
            for i in range(config.num_hidden_layers)
        ]
        super().__init__(config, layers, parallel)

    def kv_cache_spec(self) -> KVCacheSpec:
        return mha_cache_spec(self.config, self.parallel)
