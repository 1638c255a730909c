"""Where the corun GEMM's time goes at M 128 / 256 on the shapes that miss 0.85 of cuBLAS.

Qwen3-8B's qkv (N 6144, K 4096) at M 128 runs at 0.79 of cuBLAS on an H100 with the best of 80
candidates (tune-gemm-qwen3-8b-mid-m-h100.json): 96 tiles of 128 x 64 on 132 SMs, and stream-K,
which shares the iterations among all SMs, at 39 us against the pick's 26. This times, per shape:

- ``pick_us`` and ``cublas_us``: the policy's config and ``F.linear``;
- each variant (tile, depth, warps, split-K, persistence, stream-K programs) in full and its
  reduce launch alone
  (``reduce_us``: the fp32 partials summed into the output), so a split's cost is told from its
  product's;
- ``loads_only``: the same TMA tile loads at the same depth without the product (each program
  keeps a running max of its tiles, so none is dropped), once over the pick's whole tiles and
  once over 132 equal shares of the (column tile, K block) iterations as stream-K cuts them:
  how fast this Triton's pipeline streams the operands into registers; and the fastest
  whole-tile variant's loads over its whole tiles (``loads_only_fastest_whole``), also where the
  pick's row tile does not cover M. Not a floor: the running max reads every tile into
  registers, which a wgmma (reading shared memory) never does, and at a short K (the qkv layers)
  it ran slower than the whole GEMM of the same tile on an H100 (2026-12-06);
- ``copy_us``: a device copy of the weights (read and write, torch), the card's own rate.

    python -m experiments.probe_gemm_mid_m   -> experiments/results/probe-gemm-mid-m-<card>.json
"""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a file: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from experiments.harness import bench_us, copy_reference_us, probe_main  # noqa: E402
from kernels.gemm import (  # noqa: E402
    SMEM_BUDGET_BYTES,
    GemmConfig,
    gemm,
    gemm_config,
    reduce_partials,
    stream_k_pieces,
    stream_k_programs,
)
from kernels.mode import Mode  # noqa: E402
from kernels.utils import cdiv, device_card  # noqa: E402

# The H100's lowest rows at M 128 / 256 (kernels-h100.json, the H200's table): 0.75-0.80.
SHAPES = (("qwen3-8b.qkv", 6144, 4096), ("qwen3-8b.gate_up", 24576, 4096),
          ("qwen3-30b-a3b.qkv", 5120, 2048), ("deepseek-v3.q_b", 24576, 1536))
M_VALUES = (128, 256)


def variants(m: int) -> dict[str, GemmConfig]:
    """The tiles and cuts timed at M, all TMA-fed (the H100 tune's winners are): whole tiles of
    64 / 128 / 256 columns at every pipeline depth that fits and at 4 and 8 warps; each tile at
    3 stages also split 2, persistent, and stream-K over one and two programs an SM."""
    tiles = ((128, 64, 64), (128, 64, 128), (128, 128, 64), (128, 256, 64))
    if m > 128:  # 256-row tiles read each weight tile once; 256 x 256 is past the registers
        tiles += ((256, 64, 64), (256, 128, 64))
    out = {}
    for bm, bn, bk in tiles:
        stage_bytes = (bm + bn) * bk * 2
        for warps in (4, 8):
            if warps == 4 and bm * bn > 128 * 128:
                continue  # 128 fp32 accumulators a thread and more: past the registers
            for stages in range(3, 8):
                if stages * stage_bytes > SMEM_BUDGET_BYTES:  # the policy's cap
                    break
                out[f"{bm}x{bn}x{bk} w{warps} s{stages}"] = GemmConfig(
                    bm, bn, bk, num_warps=warps, num_stages=stages, tma=True)
        tile = GemmConfig(bm, bn, bk, num_warps=8, num_stages=3, tma=True)
        out[f"{bm}x{bn}x{bk} w8 s3 split 2"] = dataclasses.replace(tile, split_k=2)
        out[f"{bm}x{bn}x{bk} w8 s3 persistent"] = dataclasses.replace(tile, persistent=True)
        if bm >= m:  # stream-K runs one row tile
            for programs in (132, 264):
                out[f"{bm}x{bn}x{bk} w8 s3 stream-K {programs}"] = dataclasses.replace(
                    tile, stream_k_programs=programs)
    return out


def reduce_us(m: int, n: int, k: int, cfg: GemmConfig) -> float | None:
    """The reduce launch of ``gemm`` with ``cfg`` alone (None where the config writes the
    output directly), on a workspace of the launcher's shape."""
    if cfg.stream_k_programs > 0:
        slots, programs = stream_k_pieces(n, k, cfg), stream_k_programs(n, k, cfg)
    else:
        k_blocks = cdiv(k, cfg.block_k)
        slots, programs = cdiv(k_blocks, cdiv(k_blocks, cfg.split_k)), 0
    if slots <= 1:
        return None
    workspace = torch.randn((slots, m, n), dtype=torch.float32, device="cuda")
    out = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
    return bench_us(lambda: reduce_partials(workspace, None, out, k, slots, programs, cfg), 10, 30)


@triton.jit
def _loads_only_kernel(x_desc, w_desc, out_ptr, K, N,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       NUM_STAGES: tl.constexpr):
    """Program p streams iterations [p * T // P, (p + 1) * T // P) of the T = column tiles x K
    blocks, loading the x and w tiles a GEMM program would (row tile 0), no product."""
    pid = tl.program_id(0)
    k_blocks = tl.cdiv(K, BLOCK_K)
    total = tl.cdiv(N, BLOCK_N) * k_blocks
    start = (pid * total) // tl.num_programs(0)
    end = ((pid + 1) * total) // tl.num_programs(0)
    keep_x = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    keep_w = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for it in tl.range(start, end, num_stages=NUM_STAGES):
        pid_n = it // k_blocks
        kb = it % k_blocks
        keep_x = tl.maximum(keep_x, x_desc.load([0, kb * BLOCK_K]).to(tl.float32))
        keep_w = tl.maximum(keep_w, w_desc.load([pid_n * BLOCK_N, kb * BLOCK_K]).to(tl.float32))
    tl.store(out_ptr + pid, tl.max(tl.max(keep_x, axis=1), axis=0)
             + tl.max(tl.max(keep_w, axis=1), axis=0))


def loads_only_us(x: torch.Tensor, w: torch.Tensor, cfg: GemmConfig, programs: int) -> float:
    """``_loads_only_kernel`` over ``programs`` equal shares at ``cfg``'s tile and depth."""
    x_desc = TensorDescriptor.from_tensor(x, [cfg.block_m, cfg.block_k])
    w_desc = TensorDescriptor.from_tensor(w, [cfg.block_n, cfg.block_k])
    out = torch.empty(programs, device=x.device, dtype=torch.float32)
    k, n = x.shape[1], w.shape[0]
    return bench_us(lambda: _loads_only_kernel[(programs,)](
        x_desc, w_desc, out, k, n, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, NUM_STAGES=cfg.num_stages, num_warps=cfg.num_warps), 5, 20)


def replays_loads(cfg: GemmConfig, m: int) -> bool:
    """Whether ``_loads_only_kernel`` replays ``cfg``'s loads: TMA-fed, K not cut (no split or
    stream-K), and one row tile covering M (the kernel loads row tile 0 only)."""
    return cfg.tma and cfg.keeps_k_whole and m <= cfg.block_m


def fastest_whole_tile(variants: list[dict], m: int) -> tuple[dict, GemmConfig] | None:
    """The fastest timed variant of whole tiles (not persistent) whose loads
    ``_loads_only_kernel`` replays, with its config."""
    whole = [(v, c) for v in variants if "us" in v
             for c in [GemmConfig.from_dict(v["config"])]
             if not c.persistent and replays_loads(c, m)]
    return min(whole, key=lambda vc: vc[0]["us"]) if whole else None


def collect() -> list[dict]:
    records = []
    for label, n, k in SHAPES:
        torch.manual_seed(0)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / math.sqrt(k)
        for m in M_VALUES:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            pick = gemm_config(m, n, k, torch.bfloat16, Mode.CORUN, card=device_card(w.device))
            cublas_us = bench_us(lambda x=x, w=w: F.linear(x, w), 10, 30)
            pick_us = bench_us(lambda x=x, w=w: gemm(x, w, mode=Mode.CORUN), 10, 30)
            record = {
                "layer": label, "M": m, "N": n, "K": k,
                "cublas_us": round(cublas_us, 3), "pick_us": round(pick_us, 3),
                "pick_ratio": round(cublas_us / pick_us, 4), "pick": pick.to_dict(),
                "copy_us": round(copy_reference_us(2 * w.numel() * w.element_size()), 3),
                "variants": [],
            }
            if replays_loads(pick, m):
                tiles = cdiv(n, pick.block_n)
                for programs, what in ((tiles, "whole tiles"), (132, "132 shares")):
                    us = loads_only_us(x, w, pick, programs)
                    record[f"loads_only_{what.replace(' ', '_')}_us"] = round(us, 3)
            for name, cfg in variants(m).items():
                try:
                    us = bench_us(lambda x=x, w=w, c=cfg: gemm(x, w, config=c), 5, 20)
                except Exception as err:  # a tile that does not build is a finding
                    record["variants"].append({"name": name, "error": f"{err}"[:200]})
                    continue
                red = reduce_us(m, n, k, cfg)
                record["variants"].append({
                    "name": name, "config": cfg.to_dict(), "us": round(us, 3),
                    "ratio": round(cublas_us / us, 4),
                    "reduce_us": None if red is None else round(red, 3)})
            # The pick's loads above need its row tile to cover M; the fastest whole tile's
            # are replayed at every point (Qwen3-30B-A3B's qkv at M 128 picks 64 rows).
            whole = fastest_whole_tile(record["variants"], m)
            if whole:
                fastest, cfg = whole
                record["loads_only_fastest_whole"] = {
                    "name": fastest["name"],
                    "us": round(loads_only_us(x, w, cfg, cdiv(n, cfg.block_n)), 3)}
            records.append(record)
            print(record, flush=True)
    return records


def main() -> int:
    return probe_main("gemm-mid-m", collect)


if __name__ == "__main__":
    raise SystemExit(main())
