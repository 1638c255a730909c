"""Attention over the paged KV cache, and the GQA self-attention block of Qwen3 / Qwen3-MoE.

``PagedAttention`` is the only place a layer touches the cache: the step's K/V are written at
``batch.slot_mapping``, then prefill attends causally over each sequence's cached context and
decode runs one query per slot with ``batch.max_seq_len`` and ``batch.ops.decode_split_size``
(DESIGN.md section 3: the split count depends on a sequence's own length, so under corun and
batch_invariant a sequence's output does not depend on its co-runners).
"""

from __future__ import annotations

import torch
from torch import nn

from models import ops
from models.config import ModelConfig
from models.forward_batch import ForwardBatch
from models.layers.linear import Linear, MergedLinear
from models.layers.norm import RMSNorm
from models.layers.rotary import RotaryEmbedding


class PagedAttention(nn.Module):
    """store_kv, then prefill or decode attention of one layer's cache."""

    def __init__(self, layer_idx: int, scale: float) -> None:
        super().__init__()
        self.layer_idx, self.scale = layer_idx, scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        k_cache, v_cache = batch.kv_cache.kv(self.layer_idx)
        ops.store_kv(k, v, k_cache, v_cache, batch.slot_mapping, batch.ops)
        if batch.is_prefill:
            return ops.prefill_attention(q, k_cache, v_cache, batch, self.scale)
        return ops.decode_attention(q, k_cache, v_cache, batch, self.scale)


class GQAAttention(nn.Module):
    """Qwen3 attention: fused q|k|v, per-head RMSNorm of q and k over head_dim before NeoX RoPE,
    grouped-query attention with scale head_dim^-0.5, o_proj from heads*head_dim (which may be
    wider than hidden: 32 x 128 over 2048 for Qwen3-30B-A3B)."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(config.hidden_size, [q_size, kv_size, kv_size],
                                     bias=config.attention_bias)
        self.o_proj = Linear(q_size, config.hidden_size)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(self.head_dim, config.max_position_embeddings,
                                          config.rope_theta, config.rope_scaling, is_neox=True)
        self.attn = PagedAttention(layer_idx, self.head_dim**-0.5)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x, batch.ops)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = self.q_norm(q.reshape(num_tokens, self.num_heads, self.head_dim), batch.ops)
        k = self.k_norm(k.reshape(num_tokens, self.num_kv_heads, self.head_dim), batch.ops)
        q, k = self.rotary_emb(q, k, batch.positions, batch.ops)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        out = self.attn(q, k, v, batch)
        return self.o_proj(out.reshape(num_tokens, q_size), batch.ops)
