"""How fast MLA prefill's two products run in Triton with the softmax taken out.

Issue 13 asks MLA prefill (DeepSeek-V3's expanded prefill: 128 heads, qk 192 = 128 + 64, v 128,
causal) for >= 0.9 of causal SDPA's speed with v padded to 192; the kernel reaches 0.80-0.88 on an
H100. The kernel cannot overlap its softmax with its products on sm_90: Triton 3.6 waits for
every ``wgmma`` before the next instruction that reads its result
(``experiments/ptxas_report.py``'s ``wgmma_deferred_waits``: 0 in the kernel) and ignores
``warp_specialize`` below Blackwell, so each key tile's Q.K, softmax and P.V run one after
another, where FlashAttention-3 runs one warp group's softmax under the other's products. This
probe times the kernel's loop with the softmax taken out (the raw scores go to bf16 as they are,
P.V accumulates straight into the carried sum), at the kernel's tile (the tuned table's, 128 x
64 on 8 warps at 3 stages), over the same single sequences, beside the kernel and SDPA, so the
gap is split between the products and the softmax that runs after them.

    python -m experiments.probe_mla_prefill   -> experiments/results/probe-mla-prefill-<card>.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

if __package__ in (None, ""):  # run as a file: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments import harness  # noqa: E402

LENGTHS = (512, 1024, 2048, 4096)


@triton.jit
def _prefill_dots_tile(acc, q1, q2, k_ptr, v_ptr, start_n, offs_m, head, stride_k_t,
                       stride_v_t, BLOCK_N: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr,
                       DV: tl.constexpr, MASKED: tl.constexpr):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k_rows = offs_n.to(tl.int64) * stride_k_t + head * (D1 + D2)
    k1 = tl.load(k_ptr + k_rows[:, None] + tl.arange(0, D1)[None, :])
    k2 = tl.load(k_ptr + k_rows[:, None] + D1 + tl.arange(0, D2)[None, :])
    scores = tl.dot(q1, tl.trans(k1))
    scores = tl.dot(q2, tl.trans(k2), scores)
    if MASKED:  # the diagonal tiles: the kernel's causal select on the raw scores
        scores = tl.where(offs_n[None, :] <= offs_m[:, None], scores, 0.0)
    v_rows = offs_n.to(tl.int64) * stride_v_t + head * DV
    v = tl.load(v_ptr + v_rows[:, None] + tl.arange(0, DV)[None, :])
    return tl.dot(scores.to(v.dtype), v, acc)


@triton.jit
def _prefill_dots_kernel(q_ptr, k_ptr, v_ptr, out_ptr, num_m_tiles, stride_q_t, stride_k_t,
                         stride_v_t, stride_o_t, D1: tl.constexpr, D2: tl.constexpr,
                         DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (query tile, head) of one causal sequence, heaviest tiles first as in
    ``_mla_prefill_kernel``: acc = sum over its key tiles of (q . k^T rounded to bf16) . v, the
    key tiles below the query tile's first row unmasked, the diagonal ones masked."""
    pid_m = num_m_tiles - 1 - tl.program_id(0)
    head = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q_rows = offs_m.to(tl.int64) * stride_q_t + head * (D1 + D2)
    q1 = tl.load(q_ptr + q_rows[:, None] + tl.arange(0, D1)[None, :])
    q2 = tl.load(q_ptr + q_rows[:, None] + D1 + tl.arange(0, D2)[None, :])
    acc = tl.zeros([BLOCK_M, DV], dtype=tl.float32)
    full_end = ((pid_m * BLOCK_M + 1) // BLOCK_N) * BLOCK_N
    for start_n in range(0, full_end, BLOCK_N):
        acc = _prefill_dots_tile(acc, q1, q2, k_ptr, v_ptr, start_n, offs_m, head, stride_k_t,
                                 stride_v_t, BLOCK_N, D1, D2, DV, False)
    for start_n in range(full_end, (pid_m + 1) * BLOCK_M, BLOCK_N):
        acc = _prefill_dots_tile(acc, q1, q2, k_ptr, v_ptr, start_n, offs_m, head, stride_k_t,
                                 stride_v_t, BLOCK_N, D1, D2, DV, True)
    o_rows = offs_m.to(tl.int64) * stride_o_t + head * DV
    tl.store(out_ptr + o_rows[:, None] + tl.arange(0, DV)[None, :],
             acc.to(out_ptr.dtype.element_ty))


def prefill_dots(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, block_m: int = 128,
                 block_n: int = 64, num_warps: int = 8, num_stages: int = 3) -> torch.Tensor:
    """q, k [S, H, D1 + D2] and v [S, H, DV] of one causal sequence -> [S, H, DV]: row i of a
    head is sum over keys j <= i of (q_i . k_j rounded to v's dtype) v_j. D1 and D2 (the qk
    dim's two powers of 2, the second at least 16: 128 + 64 at DeepSeek-V3's 192) and DV powers
    of 2; S a multiple of ``block_m``, which is a multiple of ``block_n`` (no masks needed)."""
    length, heads, qk_dim = q.shape
    d1 = 1 << (qk_dim.bit_length() - 1)
    d2, dv = qk_dim - d1, v.shape[2]
    if (length % block_m or block_m % block_n or d2 < 16 or d2 & (d2 - 1) or dv & (dv - 1)
            or k.shape != q.shape or v.shape[:2] != (length, heads)):
        raise ValueError(f"prefill_dots: S % {block_m}, block_m % block_n, two powers of 2 "
                         f"(the second >= 16) for the qk dim, one for v, k like q; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty(length, heads, dv, dtype=q.dtype, device=q.device)
    num_m_tiles = length // block_m
    _prefill_dots_kernel[(num_m_tiles, heads)](
        q, k, v, out, num_m_tiles, q.stride(0), k.stride(0), v.stride(0), out.stride(0),
        D1=d1, D2=d2, DV=dv, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
    return out


def prefill_dots_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """What ``prefill_dots`` computes, in fp32 with the scores rounded to v's dtype."""
    scores = torch.einsum("ihd,jhd->hij", q.float(), k.float())
    scores = torch.tril(scores).to(v.dtype).float()
    return torch.einsum("hij,jhd->ihd", scores, v.float()).to(q.dtype)


def collect() -> list[dict]:
    from experiments import bench_mla
    from kernels.mla import mla_prefill_config
    from kernels.mode import Mode

    dims = bench_mla.v3_dims()
    cfg = mla_prefill_config(dims["qk_dim"], dims["v_dim"], bench_mla.DTYPE, Mode.CORUN)
    tile = {"block_m": cfg.block_m, "block_n": cfg.block_n, "num_warps": cfg.num_warps,
            "num_stages": cfg.num_stages, "tma": cfg.tma}  # fmt: skip
    records = []
    for length in LENGTHS:
        kernel, sdpa, x = bench_mla.prefill_case(dims, length)
        dots_us = harness.bench_us(lambda x=x: prefill_dots(
            x["q"], x["k"], x["v"], block_m=cfg.block_m, block_n=cfg.block_n,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages))  # fmt: skip
        kernel_us = harness.bench_us(kernel)
        sdpa_us = harness.bench_us(sdpa)
        records.append({
            "probe": "mla_prefill_dots", "length": length, "heads": dims["heads"],
            "qk_dim": dims["qk_dim"], "v_dim": dims["v_dim"], "tile": tile,
            "dots_us": round(dots_us, 3), "mla_prefill_us": round(kernel_us, 3),
            "sdpa_us": round(sdpa_us, 3),
            "dots_of_sdpa": round(sdpa_us / dots_us, 4),  # SDPA's time / the products' time
            "kernel_of_sdpa": round(sdpa_us / kernel_us, 4),
            "softmax_share": round(1 - dots_us / kernel_us, 4),  # of the kernel's time
        })  # fmt: skip
        print(f"len {length:5d}: products alone {sdpa_us / dots_us:.2f} of SDPA's speed, the "
              f"kernel {sdpa_us / kernel_us:.2f} (the target 0.9); the softmax after the "
              f"products {1 - dots_us / kernel_us:.0%} of the kernel's time")
    return records


def main() -> int:
    return harness.probe_main("mla-prefill", collect)


if __name__ == "__main__":
    raise SystemExit(main())
