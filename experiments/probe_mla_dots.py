"""How fast MLA decode's loop of two products runs in Triton with nothing else in it.

Issue 13 asks MLA decode (128 heads, absorbed, B >= 32, ctx >= 1024) for >= 0.5 of the memory
bound, which at DeepSeek-V3's dims is 0.37-0.45 of the measured dense MMA peak on an H100 and
0.53-0.65 on an H200 (the kernel runs at 0.16-0.24 of it). This probe times the kernel's loop
with everything but the products taken out: a contiguous cache (no block table), no softmax
(the scores go to bf16 as they are), no scaling, no split or partials, one program per (64-head
block, sequence) over the whole context, with the real kernel's step order (each tile's P.V runs
one step late, so its Q.K splits across the warp groups: ``kernels/mla_kernels.py``'s docstring)
and its literal tile (64 heads x 32 tokens, 8 warps, 3 stages). Beside it, at each point,
``mla_decode`` under ``default`` (one split from B 64 on, no partials; two at B 32) and the MMA
floor (the FLOPs at the card's measured rate): if the products alone stay under the target's
share of the peak, this Triton structure cannot reach it whatever the softmax and paging cost.
The same loop is then timed with the kernel's online softmax put back (``softmax_us``; and
``softmax_lazy_rescale_us``: the accumulator rescaled only in steps where some row's max moved,
the same bits, as FlashAttention-style kernels do), and with the paged cache and its block ids
loaded tile by tile as well (``paged_softmax_us``), so the
gap from the products to the kernel is split between them (what is left is the kernel's masks,
value handling and output).

    python -m experiments.probe_mla_dots   -> experiments/results/probe-mla-dots-<card>.json
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

if __package__ in (None, ""):  # run as a file: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments import harness  # noqa: E402

POINTS = ((32, 4096), (64, 4096), (128, 4096), (64, 16384))  # (batch, context)
BLOCK_H, BLOCK_N, NUM_WARPS, NUM_STAGES = 64, 32, 8, 3  # the literal tile (kernels/mla.py)


@triton.jit
def _mla_dots_kernel(q_ptr, kv_ptr, block_tables_ptr, out_ptr, ctx, scale, stride_q_b,
                     stride_kv_b, stride_kv_t, stride_bt_b, stride_o_b,
                     LATENT: tl.constexpr, ROPE: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_N: tl.constexpr, SOFTMAX: tl.constexpr, LAZY_RESCALE: tl.constexpr,
                     PAGE_SIZE: tl.constexpr):
    """Program (head block, sequence): acc = sum over tiles of P . V with P = q . K^T (the raw
    scores, or with SOFTMAX the kernel's base-2 online softmax of them), K = V the latent rows
    plus k_pe for the scores, P.V one step late as in ``_mla_decode_kernel``. LAZY_RESCALE: the
    accumulator is rescaled only in steps where some row's running max moved (elsewhere every
    factor is exactly 1.0 and the product would leave it bit for bit). PAGE_SIZE 0: a
    contiguous cache [B, ctx, entry]; else paged [blocks, PAGE_SIZE, entry], each tile's block
    ids loaded in the loop as the kernel's tile-by-tile path does."""
    pid_h = tl.program_id(0)
    pid_b = tl.program_id(1).to(tl.int64)
    entry: tl.constexpr = LATENT + ROPE
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, LATENT)
    offs_r = tl.arange(0, ROPE)
    q_rows = q_ptr + pid_b * stride_q_b + offs_h[:, None] * entry
    q = tl.load(q_rows + offs_d[None, :])
    q_pe = tl.load(q_rows + LATENT + offs_r[None, :])
    p_prev = tl.zeros([BLOCK_H, BLOCK_N], dtype=kv_ptr.dtype.element_ty)
    v_prev = tl.zeros([BLOCK_N, LATENT], dtype=kv_ptr.dtype.element_ty)
    acc = tl.zeros([BLOCK_H, LATENT], dtype=tl.float32)
    alpha_prev = tl.full([BLOCK_H], 1.0, dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    for start_n in range(0, ctx, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if PAGE_SIZE > 0:
            blocks = tl.load(block_tables_ptr + pid_b * stride_bt_b + offs_n // PAGE_SIZE)
            rows = kv_ptr + (blocks.to(tl.int64) * stride_kv_b
                             + (offs_n % PAGE_SIZE) * stride_kv_t)[:, None]
        else:
            rows = kv_ptr + pid_b * stride_kv_b + offs_n.to(tl.int64)[:, None] * stride_kv_t
        c = tl.load(rows + offs_d[None, :])
        k_pe = tl.load(rows + LATENT + offs_r[None, :])
        if SOFTMAX and LAZY_RESCALE:
            if tl.min(alpha_prev, 0) < 1.0:
                acc = acc * alpha_prev[:, None]
            acc = tl.dot(p_prev, v_prev, acc)
        elif SOFTMAX:
            acc = tl.dot(p_prev, v_prev, acc * alpha_prev[:, None])
        else:
            acc = tl.dot(p_prev, v_prev, acc)
        # Each product scaled before the sum, as in the kernel: a sum of the bare products
        # would make the first the second's accumulator, and with one dot feeding another
        # Triton gives the first to both warp groups (the sm_90a TTGIR's warpsPerCTA [8, 1]).
        qk = tl.dot(q, tl.trans(c)) * scale + tl.dot(q_pe, tl.trans(k_pe)) * scale
        if SOFTMAX:
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha_prev = tl.math.exp2(m_i - m_new)
            p = tl.math.exp2(qk - m_new[:, None])
            l_i = l_i * alpha_prev + tl.sum(p, 1)
            m_i = m_new
            p_prev = p.to(kv_ptr.dtype.element_ty)
        else:
            p_prev = qk.to(kv_ptr.dtype.element_ty)
        v_prev = c
    if SOFTMAX:
        acc = tl.dot(p_prev, v_prev, acc * alpha_prev[:, None]) / l_i[:, None]
    else:
        acc = tl.dot(p_prev, v_prev, acc)
    o_ptrs = out_ptr + pid_b * stride_o_b + offs_h[:, None] * LATENT + offs_d[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty))


def mla_dots(q: torch.Tensor, kv: torch.Tensor, latent: int, *, softmax: bool = False,
             lazy_rescale: bool = False, block_tables: torch.Tensor | None = None,
             ctx: int | None = None, block_h: int = BLOCK_H, block_n: int = BLOCK_N,
             num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES) -> torch.Tensor:
    """q [B, H, latent + rope] against a contiguous cache kv [B, ctx, latent + rope], or with
    ``block_tables`` [B, pages] (int32) a paged one [blocks, page, latent + rope] holding ``ctx``
    tokens a sequence -> [B, H, latent] = P . kv[..., :latent], P = q . kv^T (rounded to kv's
    dtype) or with ``softmax`` its base-2 softmax over the tokens (``lazy_rescale``: the
    accumulator rescaled only where a row's max moved, the same values); H a multiple of
    ``block_h``, ctx of ``block_n`` (and of the page size; the probe's shapes: no masks)."""
    batch, heads, entry = q.shape
    paged = block_tables is not None
    ctx = ctx if paged else kv.shape[1]
    page = kv.shape[1] if paged else 0
    if (ctx is None or heads % block_h or ctx % block_n or kv.shape[-1] != entry
            or (paged and (ctx % page or block_tables.shape[0] != batch))
            or (not paged and kv.shape[0] != batch)):
        raise ValueError(f"mla_dots: heads % {block_h}, ctx % {block_n} (and % the page) must "
                         f"be 0, kv's rows {entry} wide, one table row a sequence; got q "
                         f"{tuple(q.shape)}, kv {tuple(kv.shape)}, ctx {ctx}")
    q, kv = q.contiguous(), kv.contiguous()
    tables = block_tables.contiguous() if paged else q  # unread when contiguous
    out = torch.empty(batch, heads, latent, dtype=q.dtype, device=q.device)
    _mla_dots_kernel[(heads // block_h, batch)](
        q, kv, tables, out, ctx, 1.0, q.stride(0), kv.stride(0), kv.stride(1),
        tables.stride(0), out.stride(0),
        LATENT=latent, ROPE=entry - latent, BLOCK_H=block_h, BLOCK_N=block_n, SOFTMAX=softmax,
        LAZY_RESCALE=lazy_rescale, PAGE_SIZE=page, num_warps=num_warps, num_stages=num_stages,
    )
    return out


def mla_dots_reference(q: torch.Tensor, kv: torch.Tensor, latent: int,
                       softmax: bool = False) -> torch.Tensor:
    """What ``mla_dots`` computes, over a contiguous cache [B, ctx, latent + rope]."""
    scores = torch.bmm(q.float(), kv.float().transpose(1, 2))
    if softmax:  # base 2: the kernels' exp2 of the raw scores
        scores = torch.softmax(scores * math.log(2.0), dim=-1)
    return torch.bmm(scores.to(kv.dtype).float(), kv[..., :latent].float()).to(q.dtype)


def collect() -> list[dict]:
    from experiments.bench_mla import DTYPE, contiguous_cache, decode_cost, decode_inputs, v3_dims
    from kernels.mla import mla_decode
    from kernels.mode import Mode

    dims = v3_dims()
    records = []
    for batch, ctx in POINTS:
        x = decode_inputs(dims, [ctx] * batch, ctx, seed=batch * 100003 + ctx)
        contiguous = contiguous_cache(x, ctx).contiguous()
        q_full = torch.cat([x["q_latent"], x["q_pe"]], dim=-1)
        dots_us = harness.bench_us(
            lambda q=q_full, kv=contiguous: mla_dots(q, kv, dims["latent"]))
        softmax_us = harness.bench_us(
            lambda q=q_full, kv=contiguous: mla_dots(q, kv, dims["latent"], softmax=True))
        lazy_us = harness.bench_us(lambda q=q_full, kv=contiguous: mla_dots(
            q, kv, dims["latent"], softmax=True, lazy_rescale=True))
        paged_us = harness.bench_us(lambda q=q_full, x=x, ctx=ctx: mla_dots(
            q, x["kv_cache"], dims["latent"], softmax=True, block_tables=x["block_tables"],
            ctx=ctx))
        kernel_us = harness.bench_us(lambda x=x, ctx=ctx: mla_decode(
            **x, scale=dims["scale"], max_seq_len=ctx, mode=Mode.DEFAULT))
        cost = decode_cost(dims, batch, ctx, contiguous.element_size())
        floor_us, bound_us = cost["compute_floor_us"], cost["bound_us"]
        records.append({
            "probe": "mla_dots", "batch": batch, "context": ctx, "heads": dims["heads"],
            "dtype": str(DTYPE).removeprefix("torch."),
            "tile": {"block_h": BLOCK_H, "block_n": BLOCK_N, "num_warps": NUM_WARPS,
                     "num_stages": NUM_STAGES},
            "dots_us": round(dots_us, 3), "softmax_us": round(softmax_us, 3),
            "softmax_lazy_rescale_us": round(lazy_us, 3),
            "paged_softmax_us": round(paged_us, 3), "mla_decode_default_us": round(kernel_us, 3),
            "mma_floor_us": round(floor_us, 3), "bound_us": round(bound_us, 3),
            "dots_of_peak": round(floor_us / dots_us, 4),
            "softmax_of_peak": round(floor_us / softmax_us, 4),
            "softmax_lazy_rescale_of_peak": round(floor_us / lazy_us, 4),
            "paged_softmax_of_peak": round(floor_us / paged_us, 4),
            "kernel_of_peak": round(floor_us / kernel_us, 4),
            "target_of_peak": round(floor_us / bound_us / 2, 4),
            "dots_of_bound": round(bound_us / dots_us, 4),
            "assumes": f"MMA floor at {harness.matmul_rate() / 1e12:.0f} TFLOP/s (the card's "
                       f"measured dense bf16 rate); bound: cache + q + out once at "
                       f"{harness.bandwidth_label()}; target_of_peak: 0.5 of the bound as a "
                       "share of the peak",
        })
        print(f"B {batch:4d} ctx {ctx:6d}: of the peak, products {floor_us / dots_us:.2f}, "
              f"+ softmax {floor_us / softmax_us:.2f} (lazy rescale {floor_us / lazy_us:.2f}), "
              f"+ paging {floor_us / paged_us:.2f}, "
              f"mla_decode default {floor_us / kernel_us:.2f}; the target asks "
              f"{floor_us / bound_us / 2:.2f}")
    return records


def main() -> int:
    return harness.probe_main("mla-dots", collect)


if __name__ == "__main__":
    raise SystemExit(main())
