"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3 attention, and per layer either the softmax top-k
sparse MoE block or a dense SwiGLU MLP (``mlp_only_layers`` / ``decoder_sparse_step``).

Invariances are those of ``models.ops`` under the step's OpsConfig; routing never looks at other
tokens, and the expert GEMMs are expert-count-independent under corun / batch_invariant.
"""

from __future__ import annotations

from torch import nn

from models.config import ModelConfig
from models.forward_batch import KVCacheSpec
from models.layers.attention import GQAAttention, gqa_rotary
from models.layers.decoder import CausalLM, DecoderLayer
from models.layers.mlp import GatedMLP
from models.layers.moe import SoftmaxTopKMoE
from models.parallel import SINGLE, ParallelContext
from models.qwen3 import QWEN3_PACKED_MODULES, mha_cache_spec


class Qwen3MoeForCausalLM(CausalLM):
    packed_modules_mapping = QWEN3_PACKED_MODULES

    def __init__(self, config: ModelConfig, parallel: ParallelContext = SINGLE) -> None:
        rotary = gqa_rotary(config)  # one table, shared by every layer
        layers = []
        for i in range(config.num_hidden_layers):
            is_moe = config.is_moe_layer(i)
            mlp: nn.Module = (SoftmaxTopKMoE(config, parallel) if is_moe
                              else GatedMLP(config.hidden_size, config.intermediate_size, parallel))
            attention = GQAAttention(config, i, parallel, rotary)
            layers.append(DecoderLayer(config, attention, mlp, is_moe))
        super().__init__(config, layers, parallel)

    def kv_cache_spec(self) -> KVCacheSpec:
        return mha_cache_spec(self.config, self.parallel)
