"""What a column split would give DeepSeek-V3's kv_a GEMM (N 576) at prefill M.

kv_a (N 576 = 2.25 x 256, K 7168) sets the DeepSeek-V3 GEMM row's minimum on an H100 with the
H100's own picks (kernels-h100.json run11: 0.64 of cuBLAS at M 8192, 64 x 256 tiles, whose
third column tile computes 256 columns for 64). Power-of-two tiles cannot cover 576 columns
without waste or narrow tiles (9 of 64, 5 of 128 with 64 wasted). A column split runs the first
512 columns with wide tiles and the last 64 with narrow ones, two launches writing disjoint
columns. This times, per M:

- ``cublas_us`` and ``pick_us``: ``F.linear`` and the policy's config (one launch);
- each wide config on columns 0-511 alone and each narrow config on 512-575 alone
  (``wide`` / ``narrow``), and every pair of the two back to back (``pairs``): the pair is what
  a launcher with an ``out`` slice per part would run (the same bytes read and written; each
  part here writes its own output tensor);
- ``same_bits_as_pick``: whether the pair's two outputs are the pick's columns bit for bit (on
  Hopper a K tile accumulates in the same order whatever the tile's shape; a split of K or a
  different BLOCK_K changes the order).

    python -m experiments.probe_gemm_narrow_n  # -> results/probe-gemm-narrow-n-<card>.json
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a file: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.gemm_candidates import wave_splits  # noqa: E402
from experiments.harness import bench_us, probe_main  # noqa: E402
from kernels.gemm import GemmConfig, gemm, gemm_config  # noqa: E402
from kernels.mode import Mode  # noqa: E402
from kernels.utils import device_card  # noqa: E402

LAYER, N, K = "deepseek-v3.kv_a", 576, 7168
M_VALUES = (512, 2048, 8192)
WIDE_N = N // 256 * 256  # the columns the wide part covers: 512


def wide_configs(m: int) -> dict[str, GemmConfig]:
    """The large-M tiles on the aligned columns, TMA-fed; split K 2 / 4 where the tiles leave
    more than half the SMs idle (M 512: 8 tiles of 128 x 256)."""
    tiles = {"128x256x64 w8 s3": GemmConfig(128, 256, 64, num_warps=8, num_stages=3, tma=True),
             "128x256x64 w8 s4": GemmConfig(128, 256, 64, num_warps=8, num_stages=4, tma=True),
             "256x128x64 w8 s3": GemmConfig(256, 128, 64, num_warps=8, num_stages=3, tma=True),
             "128x128x64 w8 s4": GemmConfig(128, 128, 64, num_warps=8, num_stages=4, tma=True)}
    out = dict(tiles)
    for name, cfg in tiles.items():
        for split in wave_splits(cfg, m, WIDE_N, K, (2, 4)):
            out[f"{name} split {split.split_k}"] = split
    return out


NARROW = {"128x64x64 w4 s4": GemmConfig(128, 64, 64, num_warps=4, num_stages=4, tma=True),
          "64x64x64 w4 s4": GemmConfig(64, 64, 64, num_warps=4, num_stages=4, tma=True),
          "256x64x64 w8 s3": GemmConfig(256, 64, 64, num_warps=8, num_stages=3, tma=True),
          "128x64x128 w4 s3": GemmConfig(128, 64, 128, num_warps=4, num_stages=3, tma=True)}


def collect() -> list[dict]:
    torch.manual_seed(0)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / math.sqrt(K)
    w_wide, w_narrow = w[:WIDE_N], w[WIDE_N:]  # row slices of w: contiguous, TMA-addressable
    records = []
    for m in M_VALUES:
        x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
        pick = gemm_config(m, N, K, torch.bfloat16, Mode.CORUN, card=device_card(w.device))
        reference = gemm(x, w, mode=Mode.CORUN)
        cublas_us = bench_us(lambda x=x: F.linear(x, w), 10, 30)
        record = {"layer": LAYER, "M": m, "N": N, "K": K, "wide_n": WIDE_N,
                  "cublas_us": round(cublas_us, 3),
                  "pick_us": round(bench_us(lambda x=x: gemm(x, w, mode=Mode.CORUN), 10, 30), 3),
                  "pick": pick.to_dict(), "wide": {}, "narrow": {}, "pairs": []}
        record["pick_ratio"] = round(cublas_us / record["pick_us"], 4)
        wides = wide_configs(m)
        for part, weights, configs in (("wide", w_wide, wides), ("narrow", w_narrow, NARROW)):
            for name, cfg in configs.items():
                record[part][name] = round(bench_us(
                    lambda x=x, p=weights, c=cfg: gemm(x, p, config=c), 5, 20), 3)
        for wide_name, wide_cfg in wides.items():
            for narrow_name, narrow_cfg in NARROW.items():
                def pair(x=x, a=wide_cfg, b=narrow_cfg):
                    return gemm(x, w_wide, config=a), gemm(x, w_narrow, config=b)

                us = bench_us(pair, 5, 20)
                left, right = pair()
                record["pairs"].append({
                    "wide": wide_name, "narrow": narrow_name, "us": round(us, 3),
                    "ratio": round(cublas_us / us, 4),
                    "same_bits_as_pick": bool(torch.equal(torch.cat([left, right], 1),
                                                          reference))})
        best = min(record["pairs"], key=lambda p: p["us"])
        print(f"{LAYER} M={m}: cuBLAS {cublas_us:.2f} us, pick {record['pick_ratio']:.3f}, "
              f"best pair {best['ratio']:.3f} ({best['wide']} + {best['narrow']})", flush=True)
        records.append(record)
    return records


def main() -> int:
    return probe_main("gemm-narrow-n", collect)


if __name__ == "__main__":
    raise SystemExit(main())
