"""Why the corun GEMM runs slower at M 1 than at M 8 with the same compiled binary.

On an H100 (2026-12-05) DeepSeek-V3's kv_b (N 32768, K 512) ran at 15.0 us at M 1 and 10.6 us at
M 8, the same config and, compiled offline, the same PTX (``M`` is not specialised). This times
M 1, 8, 1, 8, 32, 1 in turn, each with ``do_bench_cudagraph`` as it was (no warm-up) and with
``harness.bench_us`` (a warm-up first), ours and cuBLAS, so order, warm-up and the card's clocks
can be told from the kernel; and the same pick with the rows past M re-reading row r % M
(``reread_rows_us``: at M 1 all 16 rows of the tile re-read the one real row) and masked out of
the x loads (``mask_rows_us``, ``GemmConfig.mask_rows``). The first run (the H100's file) found
the masked loads as fast at M 1 as at M 8, and the policy has set them where M < block_m since.

    python -m experiments.probe_gemm_m1   -> experiments/results/probe-gemm-m1-<card>.json
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

from experiments.harness import bench_us, probe_main  # noqa: E402
from kernels.gemm import gemm, gemm_config  # noqa: E402
from kernels.mode import Mode  # noqa: E402
from kernels.utils import device_card  # noqa: E402

SHAPES = (("deepseek-v3.kv_b", 32768, 512), ("deepseek-v3.shared.down", 7168, 2048))
ORDER = (1, 8, 1, 8, 32, 1)


def _unwarmed_us(fn) -> float:
    """do_bench_cudagraph as bench_us called it before its warm-up: one call, then the bench."""
    import triton.testing

    fn()
    torch.cuda.synchronize()
    return float(triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median")) * 1e3


def collect() -> list[dict]:
    records = []
    for label, n, k in SHAPES:
        torch.manual_seed(0)
        x_all = torch.randn(max(ORDER), k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / math.sqrt(k)
        for turn, m in enumerate(ORDER):
            x = x_all[:m]
            pick = gemm_config(m, n, k, torch.bfloat16, Mode.CORUN, card=device_card(w.device))
            loads = {f"{name}_us": dataclasses.replace(pick, mask_rows=mask)
                     for name, mask in (("reread_rows", False), ("mask_rows", True))}
            ours = lambda x=x, w=w: gemm(x, w, mode=Mode.CORUN)  # noqa: E731
            cublas = lambda x=x, w=w: F.linear(x, w)  # noqa: E731
            record = {
                "layer": label, "M": m, "N": n, "K": k, "turn": turn,
                "unwarmed_us": round(_unwarmed_us(ours), 3),
                "unwarmed_cublas_us": round(_unwarmed_us(cublas), 3),
                "us": round(bench_us(ours, 10, 30), 3),
                "cublas_us": round(bench_us(cublas, 10, 30), 3),
                **{key: round(bench_us(lambda x=x, w=w, c=config: gemm(x, w, config=c), 10, 30), 3)
                   for key, config in loads.items()},
                "config": pick.to_dict(),
            }
            records.append(record)
            print(record, flush=True)
    return records


def main() -> int:
    return probe_main("gemm-m1", collect,
                      timing="harness.bench_us (warm-up, CUDA-graph replay median) and "
                             "do_bench_cudagraph without the warm-up")


if __name__ == "__main__":
    raise SystemExit(main())
