"""Plain-torch references for the ops in ``kernels/``: the numerics the Triton kernels must match.
Sampling's (Philox noise, top-k / top-p, Gumbel-max) is in ``kernels/sampling_reference.py``.

Conventions (the contract the launchers follow too):

- A reference computes in ``float32`` (or in the input dtype when that is wider) and returns the
  input dtype. Call it on ``float64`` copies to get the fp64 reference the tests compare against.
- Layouts are the launchers' layouts: ``x`` [M, K] and ``w`` [N, K] (nn.Linear), token-major
  activations [T, ...], paged KV caches ``[num_blocks, block_size, num_kv_heads, head_dim]`` with
  per-sequence int32 block tables, the MLA cache
  ``[num_blocks, block_size, kv_lora_rank + rope_dim]``.
- Slot ``-1`` in a slot mapping means "padding, do not write".
- References loop per sequence / per token where that makes them obviously right; speed is not
  their job.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# ----------------------------------------------------------------------------------------------
# dense ops
# ----------------------------------------------------------------------------------------------


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def gemm_reference(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``y = x @ w.T (+ bias)`` with x [M, K], w [N, K]; fp32 (or fp64) accumulation."""
    acc = _acc_dtype(x.dtype)
    y = x.to(acc) @ w.to(acc).T
    if bias is not None:
        y = y + bias.to(acc)
    return y.to(x.dtype)


def rmsnorm_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim, as Qwen3/DeepSeek-V3 in transformers.

    With ``residual``: ``h = x + residual`` (in the input dtype, as the HF decoder layer adds),
    returns ``(rmsnorm(h), h)``; the second value is the new residual stream.
    """
    if residual is not None:
        x = x + residual
    acc = _acc_dtype(x.dtype)
    h = x.to(acc)
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * normed.to(x.dtype)
    return (out, x) if residual is not None else out


def silu_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """Gated-MLP activation: x [T, 2I] = [gate | up] -> silu(gate) * up, [T, I]."""
    inter = x.shape[-1] // 2
    acc = _acc_dtype(x.dtype)
    gate, up = x[..., :inter].to(acc), x[..., inter:].to(acc)
    return (F.silu(gate) * up).to(x.dtype)


def rope_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding on q [T, Hq, R] and k [T, Hk, R] (R = rotary dim), out of place.

    ``cos_sin_cache`` is [max_position, R]: the first R/2 columns cos, the last R/2 sin (the cache
    ``kernels.rope.build_rope_cache`` makes, YaRN's attention factor already folded in).
    ``is_neox``: rotate-half pairs (i, i + R/2) as Qwen3; otherwise GPT-J interleaved pairs
    (2i, 2i + 1) as DeepSeek-V3 (``rope_interleave``). The interleaved result stays interleaved;
    q·k is unchanged by that layout as long as q and k share it.
    """
    acc = _acc_dtype(q.dtype)
    half = cos_sin_cache.shape[-1] // 2
    cos = cos_sin_cache[positions.long(), :half].to(acc).unsqueeze(1)  # [T, 1, R/2]
    sin = cos_sin_cache[positions.long(), half:].to(acc).unsqueeze(1)

    def rotate(t: torch.Tensor) -> torch.Tensor:
        t = t.to(acc)
        if is_neox:
            x1, x2 = t[..., :half], t[..., half:]
            return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        x1, x2 = t[..., 0::2], t[..., 1::2]
        return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)

    return rotate(q).to(q.dtype), rotate(k).to(k.dtype)


# ----------------------------------------------------------------------------------------------
# attention over the paged KV cache
# ----------------------------------------------------------------------------------------------


def _gather_paged(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """Tokens 0..length-1 of one sequence from a paged cache -> [length, ...]."""
    block_size = cache.shape[1]
    token = torch.arange(length, device=cache.device)
    blocks = block_table.long()[token // block_size]
    return cache[blocks, token % block_size]


def store_kv_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write k, v [T, Hkv, D] at flat slots (block * block_size + offset); slot -1 is skipped."""
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        k_cache[slot // block_size, slot % block_size] = k[t]
        v_cache[slot // block_size, slot % block_size] = v[t]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float):
    """q [L, Hq, D], k/v [S, Hkv, D]; query i sees keys at positions <= q_pos[i]."""
    acc = _acc_dtype(q.dtype)
    group = q.shape[1] // k.shape[1]
    k = k.to(acc).repeat_interleave(group, dim=1)
    v = v.to(acc).repeat_interleave(group, dim=1)
    scores = torch.einsum("lhd,shd->hls", q.to(acc), k) * scale
    key_pos = torch.arange(k.shape[0], device=q.device)
    scores = scores.masked_fill(key_pos.view(1, 1, -1) > q_pos.view(1, -1, 1), float("-inf"))
    return torch.einsum("hls,shd->lhd", torch.softmax(scores, dim=-1), v)


def prefill_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal (chunked) prefill over the paged cache, GQA, variable length.

    q [T, Hq, D] holds each sequence's chunk back to back (``cu_seqlens_q`` [B + 1]);
    ``context_lens`` [B] is each sequence's total length *including* this chunk, whose K/V must
    already be in the cache. Query i of sequence b sits at position context_lens[b] - L_b + i.
    Rows of q after cu_seqlens_q[-1] (padding of a packed step) give zeros, as do chunks of
    length 0.
    """
    out = torch.zeros_like(q)
    cu = cu_seqlens_q.tolist()
    for b in range(len(cu) - 1):
        q_len, ctx = cu[b + 1] - cu[b], int(context_lens[b])
        if q_len == 0:
            continue
        k = _gather_paged(k_cache, block_tables[b], ctx)
        v = _gather_paged(v_cache, block_tables[b], ctx)
        q_pos = torch.arange(ctx - q_len, ctx, device=q.device)
        out[cu[b] : cu[b + 1]] = _attend(q[cu[b] : cu[b + 1]], k, v, q_pos, scale).to(q.dtype)
    return out


def decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query per sequence, q [B, Hq, D], attending to its seq_lens[b] cached tokens.

    A sequence of length 0 (a padded dummy slot) gives zeros.
    """
    out = torch.zeros_like(q)
    for b in range(q.shape[0]):
        length = int(seq_lens[b])
        if length == 0:
            continue
        k = _gather_paged(k_cache, block_tables[b], length)
        v = _gather_paged(v_cache, block_tables[b], length)
        q_pos = torch.tensor([length - 1], device=q.device)
        out[b] = _attend(q[b : b + 1], k, v, q_pos, scale)[0].to(q.dtype)
    return out


def store_mla_kv_reference(
    latent: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write [latent | k_pe] ([T, Lkv] and [T, R]) into the MLA cache [NB, BS, Lkv + R]."""
    block_size = kv_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        kv_cache[slot // block_size, slot % block_size] = torch.cat([latent[t], k_pe[t]])


def mla_decode_reference(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Absorbed MLA decode: MQA over the compressed cache, output in latent space.

    q_latent [B, H, Lkv] (q_nope already multiplied by W_UK), q_pe [B, H, R], cache rows
    [c (Lkv) | k_pe (R)]. score = scale * (q_latent·c + q_pe·k_pe); out = softmax · c, [B, H, Lkv].
    """
    acc = _acc_dtype(q_latent.dtype)
    latent_dim = q_latent.shape[-1]
    out = torch.zeros_like(q_latent)
    for b in range(q_latent.shape[0]):
        length = int(seq_lens[b])
        if length == 0:
            continue
        rows = _gather_paged(kv_cache, block_tables[b], length).to(acc)  # [S, Lkv + R]
        c, k_pe = rows[:, :latent_dim], rows[:, latent_dim:]
        scores = (q_latent[b].to(acc) @ c.T + q_pe[b].to(acc) @ k_pe.T) * scale  # [H, S]
        out[b] = (torch.softmax(scores, dim=-1) @ c).to(q_latent.dtype)
    return out


# ----------------------------------------------------------------------------------------------
# mixture of experts
# ----------------------------------------------------------------------------------------------

# A CPU elementwise kernel runs a SIMD body and a scalar tail over each thread's chunk of the flat
# buffer, and for some functions (sigmoid, silu) the two round differently (measured on AVX-512,
# torch 2.13: 3.5% of fp32 sigmoid results). Which path an element takes then depends on its flat
# index, i.e. on the row count T, its row and the thread split. Pieces that are a multiple of
# every SIMD loop step (64 elements) and at most ATen's parallel grain (32768 elements, so one
# thread runs each) put every element in the body.
ELEMENTWISE_PIECE = 16384
_SIMD_STEP = 64


def elementwise_fixed_path(fn, x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for an elementwise ``fn``, computed so that on a CPU every element's bits are
    those of the SIMD body: a function of its own value only, not of x's shape or its place.

    The flat values are zero-padded to a multiple of 64 and run in pieces of at most
    ELEMENTWISE_PIECE. Other devices call ``fn`` directly (their kernels have no scalar tail).
    """
    if x.device.type != "cpu" or x.numel() == 0:
        return fn(x)
    flat = x.reshape(-1)
    numel = flat.numel()
    piece = min(ELEMENTWISE_PIECE, -(-numel // _SIMD_STEP) * _SIMD_STEP)
    flat = F.pad(flat, (0, (-numel) % piece))
    out = torch.cat([fn(chunk) for chunk in flat.split(piece)])
    return out[:numel].view(x.shape)



def softmax_topk_reference(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE routing: softmax in fp32, top-k (sorted, lowest id first on ties), optional
    renormalisation. Returns (weights fp32 [T, k], expert ids int32 [T, k])."""
    probs = torch.softmax(router_logits.to(_acc_dtype(router_logits.dtype)), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1, sorted=True)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(torch.float32), ids.to(torch.int32)


def grouped_topk_reference(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    renormalize: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 routing (noaux_tc): sigmoid scores, + correction bias for the *choice* only,
    group score = sum of each group's top-2 biased scores, keep the best ``topk_group`` groups
    (others masked with -inf as vLLM and the DeepSeek reference do; HF masks with 0.0, which agrees
    while every biased score is positive), top-k experts, weights gathered from the unbiased
    scores, renormalised (sum + 1e-20) if asked, then always times routed_scaling_factor."""
    acc = _acc_dtype(router_logits.dtype)
    # the sigmoid of a token's logits must not depend on how many tokens share the buffer
    scores = elementwise_fixed_path(torch.sigmoid, router_logits.to(acc))
    choice = scores + correction_bias.to(acc)
    tokens, experts = choice.shape
    grouped = choice.view(tokens, n_group, experts // n_group)
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    group_ids = group_scores.topk(topk_group, dim=-1, sorted=True).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_ids, True)
    expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(tokens, experts)
    masked = choice.masked_fill(~expert_mask, float("-inf"))
    ids = masked.topk(top_k, dim=-1, sorted=True).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * routed_scaling_factor
    return weights.to(torch.float32), ids.to(torch.int32)


def fused_moe_reference(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    token_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Routed experts: out[t] = sum over rank r (in rank order) of
    w[t, r] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, r].

    x [T, H], w13 [E, 2I, H] (gate rows first, then up), w2 [E, H, I]. Each expert's intermediate
    activation is rounded to x's dtype (as the grouped GEMM stores it); the combine accumulates in
    fp32 and casts once. Tokens with ``token_mask`` False (padding) give zeros.
    """
    acc = _acc_dtype(x.dtype)
    out = torch.zeros(x.shape, dtype=acc, device=x.device)
    for t in range(x.shape[0]):
        if token_mask is not None and not bool(token_mask[t]):
            continue
        for r in range(topk_ids.shape[1]):
            e = int(topk_ids[t, r])
            gate_up = gemm_reference(x[t : t + 1], w13[e])
            hidden = silu_mul_reference(gate_up)
            expert_out = gemm_reference(hidden, w2[e]).to(acc)
            out[t] += topk_weights[t, r].to(acc) * expert_out[0]
    return out.to(x.dtype)


# ----------------------------------------------------------------------------------------------
# logits digest (corun/fingerprint.py's LogitsDigest)
# ----------------------------------------------------------------------------------------------

_DIGEST_GOLDEN_INT64 = 0x9E3779B97F4A7C15 - (1 << 64)  # signed int64 with the golden-ratio bits


def logits_digest_reference(logits: torch.Tensor) -> torch.Tensor:
    """[N, 2] int64 digest of fp32 logits [N, V]: with ``b_v`` the int32 bits of logit v widened
    to int64, d1 = sum_v b_v * (2v + 1) and d2 = sum_v b_v * h(v), h(v) = (v * golden + 1) | 1,
    all wrapping mod 2**64 (integer sums, so the order does not matter)."""
    if logits.dtype != torch.float32 or logits.dim() != 2:
        raise ValueError(f"logits: expected fp32 [N, V], got {logits.dtype} {tuple(logits.shape)}")
    v = torch.arange(logits.shape[1], dtype=torch.int64, device=logits.device)
    golden = torch.tensor(_DIGEST_GOLDEN_INT64, dtype=torch.int64, device=logits.device)
    weights = torch.stack([2 * v + 1, (v * golden + 1) | 1], dim=1)  # [V, 2]
    bits = logits.contiguous().view(torch.int32).to(torch.int64)  # [N, V]
    d1 = (bits * weights[:, 0]).sum(dim=1)
    d2 = (bits * weights[:, 1]).sum(dim=1)
    return torch.stack([d1, d2], dim=1)


def moe_align_block_size_reference(
    topk_ids: torch.Tensor, num_experts: int, block_m: int, token_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the (token, rank) pairs by expert, stably, and pad each expert to BLOCK_M rows.

    Returns ``sorted_pair_ids`` int32 [num_blocks * BLOCK_M] (pair = t * k + r; padding holds
    T * k) and ``block_expert_ids`` int32 [num_blocks] (-1 past the last used block). Within an
    expert, pairs keep token-major order (torch.sort stable). Masked tokens and ids outside
    [0, E) count toward no expert. num_blocks bounds every routing, T*k + min(E, T*k)*(BLOCK_M-1)
    rows, so no size depends on the data. (The torch version ``kernels.moe`` ran before
    ``kernels/moe_align.py``: ~25 small ops.)
    """
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    device = topk_ids.device
    num_blocks = -(-(num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m)
    max_rows = num_blocks * block_m

    expert = topk_ids.reshape(-1).to(torch.int64)
    dropped = (expert < 0) | (expert >= num_experts)
    if token_mask is not None:
        dropped = dropped | ~token_mask.view(-1, 1).expand(num_tokens, top_k).reshape(-1)
    expert = torch.where(dropped, torch.full_like(expert, num_experts), expert)  # sentinel E

    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, expert, torch.ones_like(expert))  # integer adds: order-free
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = torch.cat([padded_end.new_zeros(1), padded_end])  # [E + 1]
    count_start = torch.cumsum(counts, 0) - counts  # [E + 1]

    sorted_expert, pair = torch.sort(expert, stable=True)
    rank_in_expert = torch.arange(num_pairs, device=device) - count_start[sorted_expert]
    # dropped pairs go to distinct slots past max_rows, which are cut off below
    trash = max_rows + torch.arange(num_pairs, device=device)
    dest = torch.where(sorted_expert < num_experts,
                       padded_start[sorted_expert] + rank_in_expert, trash)
    sorted_pair_ids = torch.full((max_rows + num_pairs,), num_pairs, dtype=torch.int32,
                                 device=device)
    sorted_pair_ids.scatter_(0, dest, pair.to(torch.int32))

    block_start = torch.arange(num_blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert_ids = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_pair_ids[:max_rows], block_expert_ids
