"""Offline GEMM tuning on the H200 -> kernels/tuned/gemm_h200.json (data the policy reads).

For every real (N, K) GEMM of the named models and M in ``M_VALUES`` it times a bounded candidate
set (~8-12 configs per M bucket, fixed pools so the number of compiled kernels stays small),
keeps the median-fastest config that also matches cuBLAS numerically, and records cuBLAS's time
beside it, and the fastest candidate without split-K (``no_split_config``: what the
``batch_invariant_tuned`` policy runs at that point). The batch-invariant baseline gets ONE config:
the candidate of ``BATCH_INVARIANT_POOL``
with the lowest geometric-mean time over every swept point (they are timed at every point).

A wall-clock budget (default 200 s) bounds the sweep; points past it are left to the policy's
literal fallback and the header says ``complete: false``.

    python -m experiments.tune_gemm [--budget-s 200] [--out kernels/tuned/gemm_h200.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.harness import bench_us, header  # noqa: E402
from kernels.gemm import TUNED_PATH, GemmConfig, auto_split_k, gemm  # noqa: E402
from models.config import NAMED_CONFIGS  # noqa: E402

M_VALUES = (1, 8, 32, 64, 128, 256, 512, 2048, 8192)
DTYPE = torch.bfloat16
DEVICE = "cuda"

# One config for every M; persistent (one program per SM looping over tiles).
BATCH_INVARIANT_POOL = (
    GemmConfig(128, 128, 64, num_warps=8, num_stages=4, persistent=True),
    GemmConfig(128, 256, 64, num_warps=8, num_stages=3, persistent=True),
    GemmConfig(64, 128, 64, num_warps=4, num_stages=4, persistent=True),
    GemmConfig(64, 64, 64, num_warps=4, num_stages=4, persistent=True),
)
# (block_n, block_k, num_warps, num_stages) tiles per M range; block_m follows M for decode.
_DECODE_TILES = ((32, 256, 4, 4), (64, 128, 4, 4), (64, 256, 4, 3))
_MID_TILES = ((64, 128, 64, 4, 4), (128, 128, 64, 8, 4), (128, 64, 64, 4, 4), (64, 64, 128, 4, 4))
_LARGE_TILES = ((128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3),
                (64, 256, 64, 4, 4))


def gemm_shapes() -> list[tuple[str, int, int]]:
    """(label, N, K) of the dense GEMMs in the issue, derived from models.config.NAMED_CONFIGS."""
    shapes = []
    for name in ("qwen3-8b", "qwen3-30b-a3b"):
        c = NAMED_CONFIGS[name]
        q_dim = c.num_attention_heads * c.head_dim
        qkv = q_dim + 2 * c.num_key_value_heads * c.head_dim
        shapes += [(f"{name}.qkv", qkv, c.hidden_size), (f"{name}.o", c.hidden_size, q_dim)]
        if name == "qwen3-8b":  # 30B-A3B's MLPs are experts (the MoE kernel's job)
            shapes += [(f"{name}.gate_up", 2 * c.intermediate_size, c.hidden_size),
                       (f"{name}.down", c.hidden_size, c.intermediate_size)]
    c = NAMED_CONFIGS["deepseek-v3"]
    shapes += [
        ("deepseek-v3.q_a", c.q_lora_rank, c.hidden_size),
        ("deepseek-v3.kv_a", c.kv_lora_rank + c.qk_rope_head_dim, c.hidden_size),
        ("deepseek-v3.o", c.hidden_size, c.num_attention_heads * c.v_head_dim),
        ("deepseek-v3.dense_gate_up", 2 * c.intermediate_size, c.hidden_size),
        ("deepseek-v3.dense_down", c.hidden_size, c.intermediate_size),
    ]
    return shapes


def candidates(m: int, n: int, k: int) -> list[GemmConfig]:
    """The bounded candidate set at one point: M-range tiles, each without and with auto split-K,
    plus the batch-invariant pool (timed everywhere for its geometric mean)."""
    tiles: list[GemmConfig] = []
    if m <= 64:
        block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
        tiles = [GemmConfig(block_m, bn, bk, num_warps=w, num_stages=s)
                 for bn, bk, w, s in _DECODE_TILES]
    elif m <= 256:
        tiles = [GemmConfig(bm, bn, bk, num_warps=w, num_stages=s)
                 for bm, bn, bk, w, s in _MID_TILES]
    else:
        tiles = [GemmConfig(bm, bn, bk, num_warps=w, num_stages=s)
                 for bm, bn, bk, w, s in _LARGE_TILES]
    out: list[GemmConfig] = []
    for tile in tiles:
        out.append(tile)
        split = auto_split_k(m, n, k, tile.block_m, tile.block_n, tile.block_k)
        if split > 1:
            out.append(dataclasses.replace(tile, split_k=split))
    out += BATCH_INVARIANT_POOL
    return list(dict.fromkeys(out))  # dedupe, keep order


def _time_config(x, w, expected, config: GemmConfig, rep_ms: int) -> float | None:
    """Median us of one config, or None if it fails to compile/run or disagrees with cuBLAS."""
    try:
        out = gemm(x, w, config=config)
        if out.is_cuda:
            torch.cuda.synchronize()
    except Exception as err:  # out of shared memory / registers: not a candidate here
        print(f"    skip {config}: {type(err).__name__}: {str(err)[:120]}", file=sys.stderr)
        return None
    err = (out.float() - expected).abs().max().item() / max(expected.abs().max().item(), 1e-6)
    if not math.isfinite(err) or err > 2e-2:
        print(f"    reject {config}: rel err {err:.3g} vs cuBLAS", file=sys.stderr)
        return None
    return bench_us(lambda: gemm(x, w, config=config), warmup_ms=5, rep_ms=rep_ms)


def tune(budget_s: float = 200.0, rep_ms: int = 15) -> tuple[list[dict], GemmConfig | None, bool]:
    """Sweep every (shape, M); returns (entries, batch-invariant choice, completed in budget)."""
    start = time.monotonic()
    entries: list[dict] = []
    bi_times: dict[GemmConfig, list[float]] = {c: [] for c in BATCH_INVARIANT_POOL}
    complete = True
    torch.manual_seed(0)
    for label, n, k in gemm_shapes():
        w = torch.randn(n, k, device=DEVICE, dtype=DTYPE) / math.sqrt(k)
        for m in M_VALUES:
            if time.monotonic() - start > budget_s:
                complete = False
                break
            x = torch.randn(m, k, device=DEVICE, dtype=DTYPE)
            expected = torch.nn.functional.linear(x, w).float()
            cublas_us = bench_us(lambda x=x, w=w: torch.nn.functional.linear(x, w),
                                 warmup_ms=5, rep_ms=rep_ms)
            timed = {c: _time_config(x, w, expected, c, rep_ms) for c in candidates(m, n, k)}
            timed = {c: t for c, t in timed.items() if t is not None}
            if not timed:
                print(f"  {label} M={m}: no candidate ran", file=sys.stderr)
                continue
            if all(c in timed for c in BATCH_INVARIANT_POOL):
                for c in BATCH_INVARIANT_POOL:
                    bi_times[c].append(timed[c])
            best = min(timed, key=timed.get)
            # batch_invariant_tuned's entry: the fastest candidate that does not split K.
            no_split = {c: t for c, t in timed.items() if c.split_k == 1}
            best_no_split = min(no_split, key=no_split.get) if no_split else None
            entries.append({"m": m, "n": n, "k": k, "layer": label, "dtype": "bfloat16",
                            "config": best.to_dict(), "us": round(timed[best], 3),
                            **({"no_split_config": best_no_split.to_dict(),
                                "no_split_us": round(no_split[best_no_split], 3)}
                               if best_no_split else {}),
                            "cublas_us": round(cublas_us, 3),
                            "ratio_vs_cublas": round(cublas_us / timed[best], 4)})
            print(f"  {label:28s} M={m:5d} best {timed[best]:9.2f} us  cuBLAS {cublas_us:9.2f} us"
                  f"  ratio {cublas_us / timed[best]:.3f}  {best}", flush=True)
        if not complete:
            break
    counts = {len(v) for v in bi_times.values()}
    bi_choice = None
    if counts and min(counts) > 0 and len(counts) == 1:
        bi_choice = min(bi_times, key=lambda c: sum(math.log(t) for t in bi_times[c]))
    return entries, bi_choice, complete


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=float, default=200.0, help="sweep wall-clock budget")
    parser.add_argument("--rep-ms", type=int, default=15, help="do_bench rep per config")
    parser.add_argument("--out", type=Path, default=TUNED_PATH)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("tune_gemm: needs a CUDA device (the table is H200 timing data); nothing written.",
              file=sys.stderr)
        return 1
    if "H200" not in torch.cuda.get_device_name():
        print(f"tune_gemm: warning: tuning on {torch.cuda.get_device_name()}, not an H200",
              file=sys.stderr)
    t0 = time.monotonic()
    entries, bi_choice, complete = tune(args.budget_s, args.rep_ms)
    record = {
        "header": header(complete=complete, tuned_dtype="bfloat16", m_values=list(M_VALUES),
                         wall_s=round(time.monotonic() - t0, 1)),
        "batch_invariant": bi_choice.to_dict() if bi_choice else None,
        "entries": entries,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {len(entries)} entries to {args.out} (complete={complete}, "
          f"batch_invariant={bi_choice}) in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
