"""The op dispatch every layer calls: Triton launchers or plain torch, chosen by ``OpsConfig``.

``backend="triton"`` calls the ``kernels/`` launchers with ``ops.mode``, each imported on first
use, so the torch path never depends on a launcher file.

``backend="torch"`` is the CPU engine's path. Its invariances:

- every op is position-invariant at a fixed shape (a row's result depends on its own data and
  the shape only): row-wise ops are per row, attention runs per sequence over the paged cache;
- under ``Mode.BATCH_INVARIANT`` ``linear`` computes in fixed 16-row tiles (the last one padded),
  so every row goes through an M=16 matmul whatever M is; on a CPU ``X[:M] @ W`` row 0 differs
  between M=1 and M>=2 (gemv vs gemm), so plain matmuls are batch-variant (DESIGN.md);
- the MoE expert GEMMs use the 16-row tiles under corun and batch_invariant alike, because the
  rows an expert receives depend on the other tokens' routing (DESIGN.md section 3); the top-k
  combine sums in rank order in fp32.

Under ``Mode.DEFAULT`` the torch path is plain matmuls on the rows given (batch-variant on CPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import reference as ref
from kernels.mode import Mode
from models.forward_batch import ForwardBatch, OpsConfig

# Row tile of the batch-invariant torch matmul: every row is computed by an M=16 product.
TORCH_TILE_M = 16


def _tiled_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` over fixed 16-row tiles (zero-padded), so a row's bits never depend on M."""
    m = x.shape[0]
    pad = (-m) % TORCH_TILE_M
    padded = F.pad(x, (0, 0, 0, pad)) if pad else x
    tiles = [F.linear(padded[i : i + TORCH_TILE_M], weight, bias)
             for i in range(0, m + pad, TORCH_TILE_M)]
    return torch.cat(tiles)[:m]


def _torch_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  tiled: bool) -> torch.Tensor:
    if x.shape[0] == 0:
        return x.new_empty(0, weight.shape[0])
    return _tiled_matmul(x, weight, bias) if tiled else F.linear(x, weight, bias)


def linear(x: torch.Tensor, weight: torch.Tensor, ops: OpsConfig,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ weight[N, K].T (+ bias) -> [M, N]`` in x.dtype."""
    if ops.backend == "triton":
        from kernels.gemm import gemm

        return gemm(x, weight, bias, mode=ops.mode)
    return _torch_matmul(x, weight, bias, tiled=ops.mode == Mode.BATCH_INVARIANT)


def bmm(x: torch.Tensor, weight: torch.Tensor, ops: OpsConfig) -> torch.Tensor:
    """Per-head products ``x [G, M, K] @ weight[G, N, K].T -> [G, M, N]`` (MLA's W_UK / W_UV).

    Under batch_invariant each head is a ``linear`` (Triton GEMM, or the 16-row tiles on the
    torch path) so a row never depends on M; otherwise one batched matmul, position-invariant at
    a fixed shape (the decode batch is fixed under corun).
    """
    if ops.mode != Mode.BATCH_INVARIANT:
        return torch.matmul(x, weight.transpose(1, 2))
    return torch.stack([linear(x[g], weight[g], ops) for g in range(x.shape[0])])


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, ops: OpsConfig,
            residual: torch.Tensor | None = None
            ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim; with ``residual``, ``(norm(x + residual), x + residual)``."""
    if ops.backend == "triton":
        from kernels.norm import rmsnorm as rmsnorm_kernel

        return rmsnorm_kernel(x, weight, eps, residual, mode=ops.mode)
    return ref.rmsnorm_reference(x, weight, eps, residual)


def silu_mul(x: torch.Tensor, ops: OpsConfig) -> torch.Tensor:
    """``[T, 2I] = [gate | up] -> silu(gate) * up``, [T, I]."""
    if ops.backend == "triton":
        from kernels.activation import silu_mul as silu_mul_kernel

        return silu_mul_kernel(x, mode=ops.mode)
    return ref.silu_mul_reference(x)


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
         is_neox: bool, ops: OpsConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of q [T, Hq, R] and k [T, Hk, R] (out of place)."""
    if ops.backend == "triton":
        from kernels.rope import rope as rope_kernel

        return rope_kernel(q, k, positions, cos_sin_cache, is_neox, mode=ops.mode)
    return ref.rope_reference(q, k, positions, cos_sin_cache, is_neox)


# ---------------------------------------------------------------------------------------------
# attention over the paged cache
# ---------------------------------------------------------------------------------------------


def _write_slots(cache: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """cache [NB, BS, ...] flat-slot write of rows [T, ...]; slot -1 is padding and skipped."""
    keep = slot_mapping >= 0
    flat = cache.view(-1, *cache.shape[2:])
    flat[slot_mapping[keep]] = rows[keep].to(cache.dtype)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, ops: OpsConfig) -> None:
    """Write k, v [T, Hkv, D] into the paged caches at ``slot_mapping`` (-1 = skip)."""
    if ops.backend == "triton":
        from kernels.attention import store_kv as store_kv_kernel

        return store_kv_kernel(k, v, k_cache, v_cache, slot_mapping)
    _write_slots(k_cache, k, slot_mapping)
    _write_slots(v_cache, v, slot_mapping)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      batch: ForwardBatch, scale: float) -> torch.Tensor:
    """Causal prefill of q [T, Hq, D] over the paged cache (the chunk's K/V already stored)."""
    if batch.ops.backend == "triton":
        from kernels.attention import prefill_attention as prefill_kernel

        return prefill_kernel(q, k_cache, v_cache, batch.block_tables, batch.cu_seqlens_q,
                              batch.context_lens, scale, max_q_len=batch.max_q_len,
                              mode=batch.ops.mode)
    if batch.ops.mode is Mode.BATCH_INVARIANT:
        return _prefill_per_query(q, k_cache, v_cache, batch, scale)
    return ref.prefill_attention_reference(q, k_cache, v_cache, batch.block_tables,
                                           batch.cu_seqlens_q, batch.context_lens, scale)


def _prefill_per_query(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       batch: ForwardBatch, scale: float) -> torch.Tensor:
    """Each query token attends alone over its own causal prefix (the decode computation).

    The dynamic schedules chunk a prompt by the shared token budget, and a CPU matmul over L
    queries gives a row different bits for different L; one query at a time, with exactly its
    prefix, makes a token's bits a function of its own position only - the same as decode.
    """
    cu = batch.cu_seqlens_q.long()
    q_lens = cu[1:] - cu[:-1]
    seq_of_token = torch.repeat_interleave(torch.arange(q_lens.numel(), device=q.device), q_lens)
    token_lens = (batch.positions + 1).to(torch.int32)
    return ref.decode_attention_reference(q, k_cache, v_cache, batch.block_tables[seq_of_token],
                                          token_lens, scale)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     batch: ForwardBatch, scale: float) -> torch.Tensor:
    """One query per slot, q [B, Hq, D]; dummy slots (seq_len 0) give zeros."""
    if batch.ops.backend == "triton":
        from kernels.attention import decode_attention as decode_kernel

        return decode_kernel(q, k_cache, v_cache, batch.block_tables, batch.seq_lens, scale,
                             max_seq_len=batch.max_seq_len, mode=batch.ops.mode,
                             split_size=batch.ops.decode_split_size)
    return ref.decode_attention_reference(q, k_cache, v_cache, batch.block_tables,
                                          batch.seq_lens, scale)


def store_mla_kv(latent: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, ops: OpsConfig) -> None:
    """Write [latent | k_pe] ([T, Lkv], [T, R]) into the MLA cache [NB, BS, Lkv + R]."""
    if ops.backend == "triton":
        from kernels.mla import store_mla_kv as store_mla_kernel

        return store_mla_kernel(latent, k_pe, kv_cache, slot_mapping)
    _write_slots(kv_cache, torch.cat([latent, k_pe], dim=-1), slot_mapping)


def mla_decode(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
               batch: ForwardBatch, scale: float) -> torch.Tensor:
    """Absorbed MLA decode: [B, H, Lkv] queries over the latent cache -> [B, H, Lkv]."""
    if batch.ops.backend == "triton":
        from kernels.mla import mla_decode as mla_decode_kernel

        return mla_decode_kernel(q_latent, q_pe, kv_cache, batch.block_tables, batch.seq_lens,
                                 scale, max_seq_len=batch.max_seq_len, mode=batch.ops.mode,
                                 split_size=batch.ops.decode_split_size)
    return ref.mla_decode_reference(q_latent, q_pe, kv_cache, batch.block_tables,
                                    batch.seq_lens, scale)


def mla_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, scale: float,
                          max_q_len: int, ops: OpsConfig) -> torch.Tensor:
    """Dense varlen causal attention, bottom-right aligned: q [T, H, Dqk], k [S, H, Dqk],
    v [S, H, Dv] -> [T, H, Dv]; query i of sequence b sits at position k_len - q_len + i."""
    if ops.backend == "triton":
        from kernels.mla import mla_prefill_attention as mla_prefill_kernel

        return mla_prefill_kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, scale,
                                  max_q_len=max_q_len, mode=ops.mode)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cu_q) - 1):
        qb = q[cu_q[b] : cu_q[b + 1]].to(acc)
        kb, vb = k[cu_k[b] : cu_k[b + 1]].to(acc), v[cu_k[b] : cu_k[b + 1]].to(acc)
        q_pos = torch.arange(qb.shape[0], device=q.device) + (kb.shape[0] - qb.shape[0])
        if ops.mode is Mode.BATCH_INVARIANT:
            # One query at a time over exactly its causal prefix: a token's bits must not depend
            # on how the dynamic schedule chunked its prompt (see _prefill_per_query).
            for i, pos in enumerate(q_pos.tolist()):
                scores = torch.einsum("hd,shd->hs", qb[i], kb[: pos + 1]) * scale
                out[cu_q[b] + i] = torch.einsum(
                    "hs,shd->hd", torch.softmax(scores, dim=-1), vb[: pos + 1]).to(q.dtype)
            continue
        k_pos = torch.arange(kb.shape[0], device=q.device)
        scores = torch.einsum("lhd,shd->hls", qb, kb) * scale
        scores = scores.masked_fill(k_pos.view(1, 1, -1) > q_pos.view(1, -1, 1), float("-inf"))
        out[cu_q[b] : cu_q[b + 1]] = torch.einsum(
            "hls,shd->lhd", torch.softmax(scores, dim=-1), vb).to(q.dtype)
    return out


# ---------------------------------------------------------------------------------------------
# mixture of experts
# ---------------------------------------------------------------------------------------------


def softmax_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                 ops: OpsConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE routing -> (weights f32 [T, k], ids int32 [T, k])."""
    if ops.backend == "triton":
        from kernels.moe import softmax_topk as softmax_topk_kernel

        return softmax_topk_kernel(router_logits, top_k, renormalize, mode=ops.mode)
    return ref.softmax_topk_reference(router_logits, top_k, renormalize)


def grouped_topk(router_logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int,
                 n_group: int, topk_group: int, renormalize: bool, routed_scaling_factor: float,
                 ops: OpsConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 noaux_tc routing -> (weights f32 [T, k], ids int32 [T, k])."""
    if ops.backend == "triton":
        from kernels.moe import grouped_topk as grouped_topk_kernel

        return grouped_topk_kernel(router_logits, correction_bias, top_k, n_group, topk_group,
                                   renormalize, routed_scaling_factor, mode=ops.mode)
    return ref.grouped_topk_reference(router_logits, correction_bias, top_k, n_group, topk_group,
                                      renormalize, routed_scaling_factor)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, ops: OpsConfig,
              token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Routed experts, x [T, H], w13 [E, 2I, H] (gate rows first), w2 [E, H, I] -> [T, H].

    Torch path: one pass per expert that received rows (in expert-id order), each row's
    intermediate rounded to x.dtype as the grouped GEMM stores it, then the combine
    ``sum_r w[t, r] * y[t, r]`` in rank order in fp32. Masked-out tokens give zeros.
    """
    if ops.backend == "triton":
        from kernels.moe import fused_moe as fused_moe_kernel

        return fused_moe_kernel(x, w13, w2, topk_weights, topk_ids, mode=ops.mode,
                                token_mask=token_mask)
    tiled = ops.mode != Mode.DEFAULT
    num_tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1).long()
    flat_tokens = torch.arange(num_tokens, device=x.device).repeat_interleave(top_k)
    valid = torch.ones_like(flat_ids, dtype=torch.bool)
    if token_mask is not None:
        valid = token_mask.to(torch.bool)[flat_tokens]
    expert_out = x.new_zeros(num_tokens * top_k, x.shape[1])
    for expert in torch.unique(flat_ids[valid]).tolist():
        rows = torch.nonzero((flat_ids == expert) & valid).squeeze(1)
        gate_up = _torch_matmul(x[flat_tokens[rows]], w13[expert], None, tiled)
        hidden = ref.silu_mul_reference(gate_up)
        expert_out[rows] = _torch_matmul(hidden, w2[expert], None, tiled)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    per_rank = expert_out.view(num_tokens, top_k, -1).to(acc)
    weights = torch.where(valid.view(num_tokens, top_k), topk_weights.to(acc), 0.0)
    out = torch.zeros(x.shape, dtype=acc, device=x.device)
    for rank in range(top_k):
        out += weights[:, rank : rank + 1] * per_rank[:, rank]
    return out.to(x.dtype)
