"""Multi-head latent attention (DeepSeek-V3), with HF module names.

Per token the cache holds one row ``[latent c (kv_lora_rank) | k_pe (qk_rope_head_dim)]``: the
kv_a_layernorm-ed latent and the roped, head-shared k_pe (576 values for V3).

- Prefill (compute-friendly): store the chunk's rows, gather each sequence's whole context from
  the cache, expand it with kv_b_proj into per-head k_nope / v, and run dense causal attention
  (``mla_prefill_attention``, bottom-right aligned) with qk dim nope + rope. Under path
  invariance (``OpsConfig.is_path_invariant``) each prefill token takes the absorbed decode path
  instead, one "sequence" per token, so a token's prefill row has its decode's bits.
- Decode (absorbed): ``q_latent = q_nope @ W_UK`` per head, MQA over the latent cache
  (``mla_decode``, split at the fixed decode split size under corun / batch_invariant), then
  ``@ W_UV`` and o_proj. W_UK / W_UV are split out of kv_b_proj after loading.
- Mixed step (``batch.num_decode_tokens`` > 0): the decode tokens, first in the batch, take the
  absorbed decode path and the chunks the expanded prefill path, so a decode token gets the bits
  of a pure decode step whatever prefill chunks share its step.

Softmax scale ``qk_head_dim^-0.5 * mscale(factor, mscale_all_dim)^2`` in both forms (0.13523 for
V3). RoPE rotates interleaved (GPT-J) pairs when the config's ``rope_interleave`` is true, as
DeepSeek-V3's is, and NeoX halves when it is false, as transformers does.

Tensor parallel by heads: q_b_proj (or q_proj) and kv_b_proj are column-parallel with whole
heads per rank, o_proj row-parallel with the all-reduce; q_a_proj, kv_a_proj_with_mqa and the
latent norms are replicated, so every rank computes and caches the same latent rows (the latent
cache is replicated) and attends with its own heads.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.mode import Mode
from models import ops
from models.config import ModelConfig
from models.forward_batch import ForwardBatch
from models.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear
from models.layers.norm import RMSNorm
from models.layers.rotary import RotaryEmbedding, yarn_softmax_scale_factor
from models.parallel import SINGLE, ParallelContext

# HF builds q_a_layernorm / kv_a_layernorm with the RMSNorm default eps, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def mla_rotary(config: ModelConfig) -> RotaryEmbedding:
    """The RoPE of an MLA model (qk_rope_head_dim, interleaved pairs unless the config says
    otherwise, every position the model serves): one per model, shared by its layers."""
    return RotaryEmbedding(config.qk_rope_head_dim, config.max_sequence_length, config.rope_theta,
                           config.rope_scaling, is_neox=not config.rope_interleave)


class MLAAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int,
                 parallel: ParallelContext = SINGLE, rotary: RotaryEmbedding | None = None
                 ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        head_start, head_stop = parallel.shard(config.num_attention_heads, "num_attention_heads")
        self.num_heads = head_stop - head_start  # local heads
        full_heads = config.num_attention_heads
        self.nope_dim, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.kv_lora_rank = config.v_head_dim, config.kv_lora_rank
        qk_dim, hidden = config.qk_head_dim, config.hidden_size
        self.has_q_lora = bool(config.q_lora_rank)  # None/0: a plain q_proj
        if self.has_q_lora:
            self.q_a_proj = Linear(hidden, config.q_lora_rank, bias=config.attention_bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(config.q_lora_rank, [full_heads * qk_dim],
                                                 parallel)
        else:
            self.q_proj = ColumnParallelLinear(hidden, [full_heads * qk_dim], parallel)
        self.kv_a_proj_with_mqa = Linear(hidden, self.kv_lora_rank + self.rope_dim,
                                         bias=config.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(
            self.kv_lora_rank, [full_heads * (self.nope_dim + self.v_dim)], parallel)
        self.o_proj = RowParallelLinear(full_heads * self.v_dim, hidden, parallel,
                                        bias=config.attention_bias)
        self.rotary_emb = rotary if rotary is not None else mla_rotary(config)
        self.scale = qk_dim**-0.5 * yarn_softmax_scale_factor(config.rope_scaling)
        self.w_uk_t: torch.Tensor | None = None  # [H, Lkv, nope], set by split_kv_b_proj

    def split_kv_b_proj(self) -> None:
        """W_UK (transposed, contiguous, for the absorbed query) and W_UV (a view). Again after
        a weight update: into the same storage, which captured CUDA graphs read."""
        kv_b = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim,
                                          self.kv_lora_rank)
        w_uk_t = kv_b[:, : self.nope_dim].transpose(1, 2)
        if self.w_uk_t is not None and self.w_uk_t.shape == w_uk_t.shape:
            with torch.no_grad():
                self.w_uk_t.copy_(w_uk_t)
        else:
            self.w_uk_t = w_uk_t.contiguous()

    @property
    def w_uv(self) -> torch.Tensor:
        """[H, v_dim, Lkv] view of kv_b_proj."""
        kv_b = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim,
                                          self.kv_lora_rank)
        return kv_b[:, self.nope_dim :]

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        num_tokens, o = x.shape[0], batch.ops
        if self.has_q_lora:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x, o), o), o)
        else:
            q = self.q_proj(x, o)
        q = q.view(num_tokens, self.num_heads, self.nope_dim + self.rope_dim)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x, o).split([self.kv_lora_rank, self.rope_dim], -1)
        latent = self.kv_a_layernorm(latent, o)
        q_pe, k_pe = self.rotary_emb(q_pe, k_pe.view(num_tokens, 1, self.rope_dim),
                                     batch.positions, o)
        kv_cache, k_pe = batch.kv_cache.latent(self.layer_idx), k_pe[:, 0]
        if not batch.is_prefill:
            ops.store_mla_kv(latent, k_pe, kv_cache, batch.slot_mapping, o)
            out = self._decode(q_nope, q_pe, kv_cache, batch)
        elif batch.num_decode_tokens == 0:
            out = self._prefill(q_nope, q_pe, latent, k_pe, kv_cache, batch)
        else:  # each part stores its own tokens: they attend to their own sequences only
            nd = batch.num_decode_tokens
            ops.store_mla_kv(latent[:nd], k_pe[:nd], kv_cache, batch.slot_mapping[:nd], o)
            out = self._decode(q_nope[:nd], q_pe[:nd], kv_cache, batch.decode_part())
            if nd < num_tokens:
                prefill = self._prefill(q_nope[nd:], q_pe[nd:], latent[nd:], k_pe[nd:],
                                        kv_cache, batch.prefill_part())
                out = torch.cat([out, prefill])
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.v_dim), o)

    def _prefill(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                 k_pe: torch.Tensor, kv_cache: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Store the chunk's cache rows and attend. Path invariance: each token through the
        absorbed decode (``_prefill_as_decode``); otherwise the expanded, compute-friendly form
        (``_prefill_expanded``)."""
        if batch.ops.is_path_invariant:
            return self._prefill_as_decode(q_nope, q_pe, latent, k_pe, kv_cache, batch)
        ops.store_mla_kv(latent, k_pe, kv_cache, batch.slot_mapping, batch.ops)
        return self._prefill_expanded(torch.cat([q_nope, q_pe], dim=-1), kv_cache, batch)

    def _prefill_as_decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                           k_pe: torch.Tensor, kv_cache: torch.Tensor,
                           batch: ForwardBatch) -> torch.Tensor:
        """Every prefill token runs the decode computation over its own causal prefix: the
        absorbed products (per head, batch-invariant GEMMs, so a row's bits are those at the
        decode's M) around ``ops.mla_attention`` (the cache write, then ``mla_decode`` with one
        "sequence" per token), so its rows have its decode's bits. The expanded form reduces
        other products (k_nope = c @ W_UK, then q . k over nope + rope) and cannot."""
        w_uk_t = self.w_uk_t
        if batch.ops.differentiable:  # a trainer's forward: W_UK as a view of the parameter
            w_uk_t = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim,
                                                self.kv_lora_rank)[:, : self.nope_dim]
            w_uk_t = w_uk_t.transpose(1, 2).contiguous()
        q_latent = ops.bmm(q_nope.transpose(0, 1).contiguous(), w_uk_t, batch.ops)
        out_latent = ops.mla_attention(q_latent.transpose(0, 1).contiguous(), q_pe.contiguous(),
                                       latent, k_pe, kv_cache, batch, self.scale)
        out = ops.bmm(out_latent.transpose(0, 1).contiguous(), self.w_uv, batch.ops)
        return out.transpose(0, 1)

    def _prefill_expanded(self, q: torch.Tensor, kv_cache: torch.Tensor,
                          batch: ForwardBatch) -> torch.Tensor:
        """Expand every sequence's cached context with kv_b_proj, then dense causal attention.

        The context lengths come from the host (``context_lens_host``: no device sync); only the
        real chunk rows have contexts (a packed step's padding rows have none).
        """
        block_size = kv_cache.shape[1]
        lengths = batch.context_lens_host
        if lengths is None:  # a direct caller without host lengths: read them (a device sync)
            lengths = tuple(batch.context_lens.tolist())
        if not lengths:  # a packed step of padding only (warm-up): its rows are zeros
            return q.new_zeros(q.shape[0], self.num_heads, self.v_dim)
        slots = []
        for b, length in enumerate(lengths):
            pos = torch.arange(length, device=q.device)
            slots.append(batch.block_tables[b, pos // block_size].long() * block_size
                         + pos % block_size)
        rows = kv_cache.view(-1, kv_cache.shape[-1])[torch.cat(slots)]  # [S, Lkv + R]
        context, k_pe = rows.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        if batch.ops.mode is Mode.CORUN and len(lengths) > 1:
            # corun's GEMM policy may pick its config (split-K) from M, and S = sum of the step's
            # contexts depends on the co-runners: expand each context alone, at an M that is a
            # function of its own sequence. The batch-invariant policies never read M, and
            # default does not promise anything, so they expand the step in one GEMM.
            kv = torch.cat([self.kv_b_proj(part, batch.ops)
                            for part in context.split(list(lengths))])
        else:
            kv = self.kv_b_proj(context, batch.ops)
        kv = kv.view(-1, self.num_heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k_pe = k_pe.unsqueeze(1).expand(-1, self.num_heads, -1)
        k = torch.cat([k_nope, k_pe], dim=-1)
        num_chunks = batch.context_lens.shape[0]
        cu_k = [0]
        for length in (*lengths, *([0] * (num_chunks - len(lengths)))):
            cu_k.append(cu_k[-1] + length)
        cu_seqlens_k = torch.tensor(cu_k, dtype=torch.int32).to(q.device, non_blocking=True)
        return ops.mla_prefill_attention(q, k, v.contiguous(), batch.cu_seqlens_q, cu_seqlens_k,
                                         self.scale, batch.max_q_len, batch.ops)

    def _decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        """Absorbed form: attention in the latent space, W_UV applied after."""
        if self.w_uk_t is None:
            raise RuntimeError("MLAAttention: split_kv_b_proj() was not run after loading")
        q_latent = ops.bmm(q_nope.transpose(0, 1).contiguous(), self.w_uk_t, batch.ops)
        out_latent = ops.mla_decode(q_latent.transpose(0, 1).contiguous(), q_pe.contiguous(),
                                    kv_cache, batch, self.scale)  # [B, H, Lkv]
        out = ops.bmm(out_latent.transpose(0, 1).contiguous(), self.w_uv, batch.ops)
        return out.transpose(0, 1)  # [B, H, v_dim]
