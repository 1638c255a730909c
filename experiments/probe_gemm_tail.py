"""What tail tiles (``GemmConfig.block_n_tail``) give at the GEMM points they were built for.

A tail tile covers block_n + block_n_tail columns from one x tile: 192 with 128 + 64. At
DeepSeek-V3's kv_a (N 576) that is 3 column tiles without waste, where the pick's 64 x 256 tiles
compute 768 columns for 576 (0.64 of cuBLAS at M 8192 on an H100, kernels-h100.json run11) and a
column split in two launches reaches 0.70 (probe-gemm-narrow-n-h100.json). At shapes that 256
divides, 192-wide tiles change the wave count instead: DeepSeek-V3's q_a (N 1536) at M 256 has 24
tiles of 128 x 128 (96 programs at the H100 pick's split 4, 0.82 of cuBLAS) and 16 of 128 x 192
(128 programs at split 8). This times, per point, cuBLAS, the policy's pick and each tail config
(graph replay, as the kernels benchmark), and checks each tail config's bits against the pick's
where both walk K alike (the same block_k and split; on Hopper the tile's width does not change a
row's bits).

    python -m experiments.probe_gemm_tail  # -> results/probe-gemm-tail-<card>.json
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a file: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.gemm_candidates import DTYPE, wave_splits  # noqa: E402
from experiments.harness import bench_us, probe_main  # noqa: E402
from kernels.gemm import (  # noqa: E402
    GemmConfig,
    fit_smem,
    gemm,
    gemm_config,
)
from kernels.mode import Mode  # noqa: E402
from kernels.utils import device_card  # noqa: E402

# (layer, N, K, M values): kv_a where 256 leaves waste, q_a and Qwen3-8B's qkv where it does not
# (whole numbers of 192 too) at the M whose minimums they set or sit near.
POINTS = (("deepseek-v3.kv_a", 576, 7168, (128, 512, 2048, 8192)),
          ("deepseek-v3.q_a", 1536, 7168, (128, 256)),
          ("qwen3-8b.qkv", 6144, 4096, (128, 256)))
# (block_m, block_n, block_k, warps, stages). A 128 x 192 tile takes one program an SM (123 KB
# of shared memory at 3 stages), so kv_a's 192 tiles at M 8192 run in two waves, the second 45%
# full; 64 x 192 makes 384 programs, and at 3 stages (98 KB) two fit an SM.
_TILES = ((128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4),
          (64, 128, 64, 4, 4), (64, 128, 64, 4, 3), (128, 64, 64, 4, 4))


def tail_configs(m: int, n: int, k: int) -> dict[str, GemmConfig]:
    """Each tile with its tail (half its width), TMA-fed, unsplit and split 2 / 4 / 8 where the
    programs stay within two an SM and each split keeps two K blocks."""
    out = {}
    for bm, bn, bk, warps, stages in _TILES:
        tile = fit_smem(GemmConfig(bm, bn, bk, num_warps=warps, num_stages=stages, tma=True,
                                   block_n_tail=bn // 2), DTYPE.itemsize)
        name = f"{bm}x({bn}+{bn // 2})x{bk} w{warps} s{tile.num_stages}"
        out[name] = tile
        for split in wave_splits(tile, m, n, k):
            out[f"{name} split {split.split_k}"] = split
    return out


def collect() -> list[dict]:
    records = []
    for label, n, k, m_values in POINTS:
        torch.manual_seed(0)
        w = torch.randn(n, k, device="cuda", dtype=DTYPE) / math.sqrt(k)
        for m in m_values:
            x = torch.randn(m, k, device="cuda", dtype=DTYPE)
            pick = gemm_config(m, n, k, DTYPE, Mode.CORUN, card=device_card(w.device))
            reference = gemm(x, w, mode=Mode.CORUN)
            cublas_us = bench_us(lambda x=x, w=w: F.linear(x, w), 10, 30)
            pick_us = bench_us(lambda x=x, w=w: gemm(x, w, mode=Mode.CORUN), 10, 30)
            record = {"layer": label, "M": m, "N": n, "K": k, "cublas_us": round(cublas_us, 3),
                      "pick_us": round(pick_us, 3), "pick_ratio": round(cublas_us / pick_us, 4),
                      "pick": pick.to_dict(), "tails": []}
            for name, cfg in tail_configs(m, n, k).items():
                try:
                    us = bench_us(lambda x=x, w=w, c=cfg: gemm(x, w, config=c), 5, 20)
                except Exception as err:  # a tile that does not build is a finding
                    record["tails"].append({"name": name, "error": f"{err}"[:200]})
                    continue
                same_walk = (cfg.block_k, cfg.split_k) == (pick.block_k, pick.split_k)
                record["tails"].append({
                    "name": name, "config": cfg.to_dict(), "us": round(us, 3),
                    "ratio": round(cublas_us / us, 4),
                    "same_bits_as_pick": (bool(torch.equal(gemm(x, w, config=cfg), reference))
                                          if same_walk and not pick.stream_k_programs else None)})
            timed = [t for t in record["tails"] if "us" in t]
            best = min(timed, key=lambda t: t["us"]) if timed else None
            print(f"{label} M={m}: cuBLAS {cublas_us:.2f} us, pick {record['pick_ratio']:.3f}"
                  + (f", best tail {best['ratio']:.3f} ({best['name']})" if best else ""),
                  flush=True)
            records.append(record)
    return records


def main() -> int:
    return probe_main("gemm-tail", collect)


if __name__ == "__main__":
    raise SystemExit(main())
