"""Attention over the paged KV cache, and the GQA self-attention block of Qwen3 / Qwen3-MoE.

``PagedAttention`` is the only place a layer touches the cache: the step's K/V are written at
``batch.slot_mapping``, then prefill attends causally over each sequence's cached context and
decode runs one query per slot with ``batch.max_seq_len`` and ``batch.ops.decode_split_size``
(DESIGN.md section 3: the split count depends on a sequence's own length, so under corun and
batch_invariant a sequence's output does not depend on its co-runners). In a mixed step the
decode tokens (first ``batch.num_decode_tokens``) take the decode path and the chunks the prefill
path: a decode token must not change kernels with the requests that happen to share its step.

Tensor parallel (vLLM's layout): the q heads are split evenly across ranks; the kv heads too when
there are at least as many as ranks, otherwise each kv head is replicated on W / num_kv_heads
ranks so that every rank holds the one kv head its q heads attend with. q|k|v is
column-parallel, o_proj row-parallel with the all-reduce; each rank caches its local kv heads.
"""

from __future__ import annotations

import torch
from torch import nn

from models import ops
from models.config import ModelConfig
from models.forward_batch import ForwardBatch
from models.layers.linear import ColumnParallelLinear, RowParallelLinear
from models.layers.norm import RMSNorm
from models.layers.rotary import RotaryEmbedding
from models.parallel import SINGLE, ParallelContext


def kv_head_range(num_heads: int, num_kv_heads: int, parallel: ParallelContext
                  ) -> tuple[int, int]:
    """[start, stop) of the kv heads this rank holds (ValueError naming the field that does not
    split across the tensor-parallel size)."""
    world, rank = parallel.world_size, parallel.rank
    parallel.shard(num_heads, "num_attention_heads")
    if num_kv_heads >= world:
        return parallel.shard(num_kv_heads, "num_key_value_heads")
    if world % num_kv_heads:
        raise ValueError(f"num_key_value_heads: {num_kv_heads} kv heads can not be replicated "
                         f"evenly over tensor-parallel size {world}")
    head = rank // (world // num_kv_heads)  # the kv head of this rank's q heads
    return head, head + 1


class PagedAttention(nn.Module):
    """store_kv, then prefill or decode attention of one layer's cache (``ops.attention``)."""

    def __init__(self, layer_idx: int, scale: float) -> None:
        super().__init__()
        self.layer_idx, self.scale = layer_idx, scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        k_cache, v_cache = batch.kv_cache.kv(self.layer_idx)
        return ops.attention(q, k, v, k_cache, v_cache, batch, self.scale)


def gqa_rotary(config: ModelConfig) -> RotaryEmbedding:
    """The RoPE of a GQA model (NeoX halves over head_dim, every position the model serves):
    the model builds one and its layers share it, one fp32 table rather than one a layer
    (80 x 128 MiB for Hy3's 262144 positions)."""
    return RotaryEmbedding(config.head_dim, config.max_sequence_length, config.rope_theta,
                           config.rope_scaling, is_neox=True)


class GQAAttention(nn.Module):
    """Qwen3 attention: fused q|k|v, per-head RMSNorm of q and k over head_dim before NeoX RoPE,
    grouped-query attention with scale head_dim^-0.5, o_proj from heads*head_dim (which may be
    wider than hidden: 32 x 128 over 2048 for Qwen3-30B-A3B)."""

    def __init__(self, config: ModelConfig, layer_idx: int,
                 parallel: ParallelContext = SINGLE, rotary: RotaryEmbedding | None = None
                 ) -> None:
        super().__init__()
        d = self.head_dim = config.head_dim
        q_start, q_stop = parallel.shard(config.num_attention_heads, "num_attention_heads")
        kv_start, kv_stop = kv_head_range(config.num_attention_heads,
                                          config.num_key_value_heads, parallel)
        self.num_heads, self.num_kv_heads = q_stop - q_start, kv_stop - kv_start  # local
        full_q, full_kv = config.num_attention_heads * d, config.num_key_value_heads * d
        kv_rows = (kv_start * d, kv_stop * d)
        self.qkv_proj = ColumnParallelLinear(
            config.hidden_size, [full_q, full_kv, full_kv], parallel, bias=config.attention_bias,
            local_ranges=[(q_start * d, q_stop * d), kv_rows, kv_rows])
        self.o_proj = RowParallelLinear(full_q, config.hidden_size, parallel,
                                        bias=config.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary_emb = rotary if rotary is not None else gqa_rotary(config)
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
