"""The op dispatch every layer calls: Triton launchers or plain torch, chosen by ``OpsConfig``.

``backend="triton"`` calls the ``kernels/`` launchers with ``ops.mode``, each imported on first
use, so the torch path never depends on a launcher file.

``backend="torch"`` is the CPU engine's path. A CPU's BLAS and SIMD kernels do not keep the
invariances on their own (measured on AVX-512 and AVX2, torch 2.13): an fp32 ``F.linear`` at M
in 5..11 gives rows 4+ other bits than row 0 for the same input row (M = 2, 3 too when
K % 4 != 0; any M when N is 1, 3 or 8 and K % 4 != 0); ``torch.sigmoid`` / ``F.silu`` round the
SIMD body and the scalar tail of each thread's chunk differently. So the torch path computes:

- matmuls by mode: ``default`` a plain ``F.linear`` on the rows given (position- and
  batch-variant here: the negative control); ``corun`` one product on operands zero-padded to
  multiples of ``TORCH_TILE`` in K and N, and in M unless M <= MAX_UNPADDED_ROWS (measured
  position-invariant at every such shape, 1-8 threads), sliced back; ``batch_invariant`` the
  same padding in K and N but fixed 16-row tiles, so every row goes through the same
  [16, K16] x [K16, N16] product whatever M is;
- the MoE expert GEMMs in 16-row tiles under every mode but ``default`` (an expert's row count
  depends on the other tokens' routing, DESIGN.md section 3); the top-k combine sums in rank
  order in fp32;
- sigmoid (DeepSeek router) and SiLU through ``reference.elementwise_fixed_path``, so every
  element takes the SIMD body whatever T, its position and the thread count;
- the rest per row or per sequence (rmsnorm, rope, softmax routing, paged attention: measured
  position- and T-invariant), batch_invariant prefill attention one query at a time.

``bmm`` (MLA's W_UK / W_UV) is a ``linear`` per head in the deterministic modes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import reference as ref
from kernels.mode import Mode
from models import differentiable as grad_ref
from models.differentiable import differentiable
from models.forward_batch import ForwardBatch, OpsConfig

# Rows, K and N of a deterministic torch-path matmul are zero-padded to multiples of this, and
# batch_invariant computes in tiles of this many rows: every multiple-of-16 shape measured on
# AVX-512 (M 16..2048, K 16..1024, N 16..2048, bf16/fp16/fp32, 1, 2 and 8 threads) is
# position-invariant, while some unpadded ones are not (module docstring).
TORCH_TILE = 16
# corun leaves up to this many rows unpadded: M 1..4 (and 8, 12..16) were position-invariant at
# K, N multiples of 16 (1, 2, 8 threads), M 5..7 and 9..11 were not. Small decode batches keep
# their plain product, and their batch-variance from a padded one (tests rely on it).
MAX_UNPADDED_ROWS = 4


def _pad_dim(t: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    """``t`` zero-padded at the end of ``dim`` (0 or 1 of a 2-D tensor) to a multiple."""
    pad = (-t.shape[dim]) % multiple
    if not pad:
        return t
    return F.pad(t, (0, pad) if dim == 1 else (0, 0, 0, pad))


def _padded_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   tiled: bool) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` on zero-padded operands (K, N, and M past MAX_UNPADDED_ROWS, to
    multiples of TORCH_TILE) as one product or, with ``tiled``, in TORCH_TILE-row tiles (M always
    padded); zero rows and columns add exact zeros and are sliced off. The bias is added after
    the product (exact per element)."""
    m, n = x.shape[0], weight.shape[0]
    x = _pad_dim(x, 1, TORCH_TILE)
    if tiled or m > MAX_UNPADDED_ROWS:
        x = _pad_dim(x, 0, TORCH_TILE)
    weight = _pad_dim(_pad_dim(weight, 1, TORCH_TILE), 0, TORCH_TILE)
    if tiled:
        out = torch.cat([F.linear(x[i : i + TORCH_TILE], weight)
                         for i in range(0, x.shape[0], TORCH_TILE)])
    else:
        out = F.linear(x, weight)
    out = out[:m, :n] if out.shape[1] == n else out[:m, :n].contiguous()
    return out if bias is None else out + bias


def _torch_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  mode: Mode) -> torch.Tensor:
    """The torch path's matmul by mode: plain under default, padded under corun, padded 16-row
    tiles under every batch-invariant mode (any mode but default and corun)."""
    if x.shape[0] == 0:
        return x.new_empty(0, weight.shape[0])
    if mode is Mode.DEFAULT:
        return F.linear(x, weight, bias)
    return _padded_matmul(x, weight, bias, tiled=mode is not Mode.CORUN)


@differentiable(grad_ref.linear_reference, ("x", "weight", "bias"))
def linear(x: torch.Tensor, weight: torch.Tensor, ops: OpsConfig,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ weight[N, K].T (+ bias) -> [M, N]`` in x.dtype."""
    if ops.backend == "triton":
        from kernels.gemm import gemm

        return gemm(x, weight, bias, mode=ops.gemm_mode)
    return _torch_matmul(x, weight, bias, ops.gemm_mode)


@differentiable(grad_ref.bmm_reference, ("x", "weight"))
def bmm(x: torch.Tensor, weight: torch.Tensor, ops: OpsConfig) -> torch.Tensor:
    """Per-head products ``x [G, M, K] @ weight[G, N, K].T -> [G, M, N]`` (MLA's W_UK / W_UV).

    Triton backend: one batched matmul (cuBLAS, position-invariant at a fixed shape) except
    under batch_invariant, where each head is a Triton GEMM so a row never depends on M. Torch
    backend: one batched matmul under default, else each head through ``_torch_matmul``.
    """
    if ops.backend == "triton" and not ops.gemm_mode.is_batch_invariant:
        return torch.matmul(x, weight.transpose(1, 2))
    if ops.backend == "torch" and ops.mode is Mode.DEFAULT:
        return torch.matmul(x, weight.transpose(1, 2))
    return torch.stack([linear(x[g], weight[g], ops) for g in range(x.shape[0])])


@differentiable(grad_ref.rmsnorm_reference, ("x", "weight", "residual"))
def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, ops: OpsConfig,
            residual: torch.Tensor | None = None
            ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim; with ``residual``, ``(norm(x + residual), x + residual)``."""
    if ops.backend == "triton":
        from kernels.norm import rmsnorm as rmsnorm_kernel

        return rmsnorm_kernel(x, weight, eps, residual, mode=ops.mode)
    return ref.rmsnorm_reference(x, weight, eps, residual)


@differentiable(grad_ref.silu_mul_reference, ("x",))
def silu_mul(x: torch.Tensor, ops: OpsConfig) -> torch.Tensor:
    """``[T, 2I] = [gate | up] -> silu(gate) * up``, [T, I]."""
    if ops.backend == "triton":
        from kernels.activation import silu_mul as silu_mul_kernel

        return silu_mul_kernel(x, mode=ops.mode)
    return _silu_mul_torch(x)


def _silu_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """``silu_mul_reference`` with the SiLU through ``elementwise_fixed_path``: F.silu's SIMD
    body and scalar tail round differently, and where an element falls depends on T."""
    inter = x.shape[-1] // 2
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    gate, up = x[..., :inter].to(acc), x[..., inter:].to(acc)
    return (ref.elementwise_fixed_path(F.silu, gate) * up).to(x.dtype)


@differentiable(grad_ref.rope_reference, ("q", "k"))
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


@differentiable(grad_ref.causal_attention_reference, ("q", "k", "v"))
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor, batch: ForwardBatch, scale: float) -> torch.Tensor:
    """One layer's paged attention: the step's K/V written at ``batch.slot_mapping``, then
    prefill attention over each sequence's cached context, decode (one query per slot), or, in
    a mixed step, the decode tokens (first ``batch.num_decode_tokens``) through decode and the
    chunks through prefill, so a decode token gets the kernels of a pure decode step."""
    store_kv(k, v, k_cache, v_cache, batch.slot_mapping, batch.ops)
    if not batch.is_prefill:
        return decode_attention(q, k_cache, v_cache, batch, scale)
    nd = batch.num_decode_tokens
    if nd == 0:
        return prefill_attention(q, k_cache, v_cache, batch, scale)
    # Every K/V of the step is stored above, so the two parts read a complete cache.
    out = decode_attention(q[:nd], k_cache, v_cache, batch.decode_part(), scale)
    if nd == batch.num_tokens:
        return out
    prefill = prefill_attention(q[nd:], k_cache, v_cache, batch.prefill_part(), scale)
    return torch.cat([out, prefill])


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, ops: OpsConfig) -> None:
    """Write k, v [T, Hkv, D] into the paged caches at ``slot_mapping`` (-1 = skip)."""
    if ops.backend == "triton":
        from kernels.kv_store import store_kv as store_kv_kernel

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
                              mode=batch.ops.mode, split_size=batch.ops.prefill_split_size)
    if batch.ops.mode.is_batch_invariant or batch.ops.is_path_invariant:
        return _prefill_per_query(q, k_cache, v_cache, batch, scale)
    return ref.prefill_attention_reference(q, k_cache, v_cache, batch.block_tables,
                                           batch.cu_seqlens_q, batch.context_lens, scale)


def _prefill_per_query(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       batch: ForwardBatch, scale: float) -> torch.Tensor:
    """Each query token attends alone over its own causal prefix (the decode computation).

    The dynamic schedules chunk a prompt by the shared token budget, and a CPU matmul over L
    queries gives a row different bits for different L; one query at a time, with exactly its
    prefix, makes a token's bits a function of its own position only - those of its decode
    (path invariance).
    """
    tokens = batch.per_token_decode()
    return ref.decode_attention_reference(q, k_cache, v_cache, tokens.block_tables,
                                          tokens.seq_lens, scale)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     batch: ForwardBatch, scale: float) -> torch.Tensor:
    """One query per slot, q [B, Hq, D]; dummy slots (seq_len 0) give zeros."""
    if batch.ops.backend == "triton":
        from kernels.attention import decode_attention as decode_kernel

        return decode_kernel(q, k_cache, v_cache, batch.block_tables, batch.seq_lens, scale,
                             max_seq_len=batch.max_seq_len, mode=batch.ops.mode,
                             split_size=batch.ops.decode_split_size,
                             fused_combine=batch.ops.decode_fused_combine,
                             arrivals=batch.decode_arrivals)
    return ref.decode_attention_reference(q, k_cache, v_cache, batch.block_tables,
                                          batch.seq_lens, scale)


def store_mla_kv(latent: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, ops: OpsConfig) -> None:
    """Write [latent | k_pe] ([T, Lkv], [T, R]) into the MLA cache [NB, BS, Lkv + R]."""
    if ops.backend == "triton":
        from kernels.kv_store import store_mla_kv as store_mla_kernel

        return store_mla_kernel(latent, k_pe, kv_cache, slot_mapping)
    _write_slots(kv_cache, torch.cat([latent, k_pe], dim=-1), slot_mapping)


# Prefill tokens one path-invariant MLA decode launch takes (``mla_attention``): its split
# partials are [tokens, heads, max splits, kv_lora_rank] fp32, 256 MiB for DeepSeek-V3's 128
# heads at 8 splits.
MLA_TOKENS_PER_LAUNCH = 128


@differentiable(grad_ref.mla_attention_reference, ("q_latent", "q_pe", "latent", "k_pe"))
def mla_attention(q_latent: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                  k_pe: torch.Tensor, kv_cache: torch.Tensor, batch: ForwardBatch,
                  scale: float) -> torch.Tensor:
    """MLA's path-invariant prefill attention in the latent space: the chunk's [latent | k_pe]
    rows written at ``batch.slot_mapping``, then each token's absorbed query ([T, H, Lkv] and
    [T, H, R]) decoded over its own causal prefix (``ForwardBatch.per_token_decode``), at most
    ``MLA_TOKENS_PER_LAUNCH`` tokens a launch -> [T, H, Lkv]."""
    store_mla_kv(latent, k_pe, kv_cache, batch.slot_mapping, batch.ops)
    tokens = batch.per_token_decode()
    # The engine's grid bound is max_model_len (the decode's, whose tile it picks); a direct
    # caller's prefill batch may leave it 0: then the block tables' capacity.
    max_seq_len = batch.max_seq_len or batch.block_tables.shape[1] * kv_cache.shape[1]
    outs = []
    for start in range(0, q_latent.shape[0], MLA_TOKENS_PER_LAUNCH):
        end = min(start + MLA_TOKENS_PER_LAUNCH, q_latent.shape[0])
        part = ForwardBatch(
            is_prefill=False, positions=tokens.positions[start:end],
            slot_mapping=tokens.slot_mapping[start:end],
            block_tables=tokens.block_tables[start:end], kv_cache=batch.kv_cache, ops=batch.ops,
            seq_lens=tokens.seq_lens[start:end], max_seq_len=max_seq_len)
        outs.append(mla_decode(q_latent[start:end], q_pe[start:end], kv_cache, part, scale))
    return torch.cat(outs)


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
        if ops.mode.is_batch_invariant:
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


@differentiable(grad_ref.softmax_topk_reference, ("router_logits",), needs_out=True)
def softmax_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                 ops: OpsConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE routing -> (weights f32 [T, k], ids int32 [T, k])."""
    if ops.backend == "triton":
        from kernels.moe import softmax_topk as softmax_topk_kernel

        return softmax_topk_kernel(router_logits, top_k, renormalize, mode=ops.mode)
    return ref.softmax_topk_reference(router_logits, top_k, renormalize)


@differentiable(grad_ref.grouped_topk_reference, ("router_logits",), needs_out=True)
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


@differentiable(grad_ref.fused_moe_reference, ("x", "w13", "w2", "topk_weights"))
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

        # Ids straight from the routers are in range: skip the host-side check (a device sync
        # per layer that stalls the launch queue).
        return fused_moe_kernel(x, w13, w2, topk_weights, topk_ids, mode=ops.gemm_mode,
                                token_mask=token_mask, check_ids=False)
    # An expert's row count depends on the other tokens' routing: 16-row tiles in every mode
    # but default, so a row's bits depend on neither that count nor its place among the rows.
    expert_mode = Mode.DEFAULT if ops.mode is Mode.DEFAULT else Mode.BATCH_INVARIANT
    num_tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1).long()
    flat_tokens = torch.arange(num_tokens, device=x.device).repeat_interleave(top_k)
    valid = torch.ones_like(flat_ids, dtype=torch.bool)
    if token_mask is not None:
        valid = token_mask.to(torch.bool)[flat_tokens]
    expert_out = x.new_zeros(num_tokens * top_k, x.shape[1])
    for expert in torch.unique(flat_ids[valid]).tolist():
        rows = torch.nonzero((flat_ids == expert) & valid).squeeze(1)
        gate_up = _torch_matmul(x[flat_tokens[rows]], w13[expert], None, expert_mode)
        hidden = _silu_mul_torch(gate_up)
        expert_out[rows] = _torch_matmul(hidden, w2[expert], None, expert_mode)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    per_rank = expert_out.view(num_tokens, top_k, -1).to(acc)
    weights = torch.where(valid.view(num_tokens, top_k), topk_weights.to(acc), 0.0)
    out = torch.zeros(x.shape, dtype=acc, device=x.device)
    for rank in range(top_k):
        out += weights[:, rank : rank + 1] * per_rank[:, rank]
    return out.to(x.dtype)
