"""GEMM on the H200: corun and batch_invariant policies vs cuBLAS, plus bitwise invariance checks.

``collect()`` times ``kernels.gemm.gemm`` under ``corun`` and ``batch_invariant`` against
``torch.nn.functional.linear`` (cuBLAS) measured in the same call, at the real (N, K) of
``experiments.gemm_shapes.gemm_shapes(BENCH_MODELS)`` (every GEMM of Qwen3-8B, Qwen3-30B-A3B and
DeepSeek-V3, LM heads included) and decode/prefill M. ``check_invariance_gpu()`` checks
position invariance (every mode), batch invariance (batch_invariant) and runs the negative controls
(default mode across M; another BLOCK_K) in bf16 at real shapes. Where M leaves the corun
pick's last row tile part empty (and it loads without TMA) a ``corun_reread_rows`` row times the
same pick with the rows past M re-reading row ``r % M`` instead of masked out of the x loads
(``GemmConfig.mask_rows``, which the policy sets where M < block_m; a ``corun_mask_rows`` row
where the pick leaves it off), and records whether its bits equal the pick's
(``same_bits_as_pick``: they must). Where N takes tail tiles (``gemm_candidates.tail_tiles``:
DeepSeek-V3's kv_a, N 576) and the pick has none, a ``corun_tail`` row per tail tile times the
pick with its columns as block_n + block_n_tail (``GemmConfig.block_n_tail``), the same K walk,
so the same bits (``same_bits_as_pick``).

    python -m experiments.bench_gemm [--quick]   -> experiments/results/gemm-h200.json
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

from experiments.gemm_candidates import tail_tiles  # noqa: E402
from experiments.gemm_shapes import BENCH_MODELS, gemm_shapes  # noqa: E402
from experiments.harness import bench_us, family_main, kernel_record, memory_bound_us  # noqa: E402
from kernels.gemm import GemmConfig, fit_smem, gemm, gemm_config, table_files  # noqa: E402
from kernels.mode import Mode  # noqa: E402
from kernels.utils import device_card  # noqa: E402

DECODE_M = (1, 8, 32, 64, 128, 256)
PREFILL_M = (512, 2048, 8192)
DTYPE = torch.bfloat16
DEVICE = "cuda"
QUICK_LAYERS = ("qwen3-8b.o", "qwen3-8b.gate_up", "deepseek-v3.kv_a")


def _require_cuda() -> None:
    if not torch.cuda.is_available():
        raise RuntimeError("bench_gemm needs a CUDA device (H200); none is available here")


def _data(m: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    x = torch.randn(m, k, device=DEVICE, dtype=DTYPE)
    w = torch.randn(n, k, device=DEVICE, dtype=DTYPE) / math.sqrt(k)
    return x, w


def collect(quick: bool = False) -> list[dict]:
    """Timing records: one per (layer, M, policy), peer cuBLAS timed at the same point."""
    _require_cuda()
    shapes = [s for s in gemm_shapes(BENCH_MODELS) if not quick or s[0] in QUICK_LAYERS]
    m_values = (1, 64, 2048) if quick else DECODE_M + PREFILL_M
    warmup_ms, rep_ms = (5, 20) if quick else (10, 30)
    card = device_card(torch.device(DEVICE))  # whose table the policies read (kernels.gemm)
    tables = [path.name for path in table_files(card)]
    records = []
    for label, n, k in shapes:
        x_all, w = _data(max(m_values), n, k)
        for m in m_values:
            x = x_all[:m]
            expected = F.linear(x, w).float()
            cublas_us = bench_us(lambda x=x, w=w: F.linear(x, w), warmup_ms, rep_ms)
            # Bytes every kernel must move at least once: x, w and the output, all bf16.
            bound_us = memory_bound_us((m * k + n * k + m * n) * DTYPE.itemsize)
            # Each policy's pick, timed through its mode; where M leaves the corun pick's last
            # row tile part empty (and it loads without TMA), the same pick with the rows past M
            # loaded the other way (masked, or re-read: at M 1 all of them re-read the one real
            # row), whose bits must equal the pick's.
            variants = [(mode.value, gemm_config(m, n, k, DTYPE, mode, card=card), {"mode": mode})
                        for mode in (Mode.CORUN, Mode.BATCH_INVARIANT)]
            corun = variants[0][1]
            if m % corun.block_m and not corun.tma:
                other = dataclasses.replace(corun, mask_rows=not corun.mask_rows)
                policy = "corun_mask_rows" if other.mask_rows else "corun_reread_rows"
                variants.append((policy, other, {"config": other}))
            if not corun.block_n_tail and not corun.stream_k_programs:
                for block_n, tail in tail_tiles(n):
                    twin = fit_smem(dataclasses.replace(corun, block_n=block_n,
                                                        block_n_tail=tail), DTYPE.itemsize)
                    variants.append(("corun_tail", twin, {"config": twin}))
            outs = {}
            for policy, config, how in variants:
                out = outs[policy] = gemm(x, w, **how)
                rel_err = ((out.float() - expected).abs().max() / expected.abs().max()).item()
                us = bench_us(lambda x=x, w=w, how=how: gemm(x, w, **how), warmup_ms, rep_ms)
                checked = ({"same_bits_as_pick": torch.equal(out, outs[Mode.CORUN.value])}
                           if "config" in how else {})
                records.append(kernel_record(
                    "gemm", policy, m, n, k, DTYPE, us, "cublas", cublas_us,
                    layer=label, phase="decode" if m in DECODE_M else "prefill",
                    bound_us=round(bound_us, 3), bw_fraction=round(bound_us / us, 4),
                    tflops=round(2 * m * n * k / us / 1e6, 2), rel_err_vs_cublas=rel_err,
                    config=config.to_dict(), tuned_tables=tables, **checked,
                ))
                print(f"{label:28s} M={m:5d} {policy:16s} {us:9.2f} us  cuBLAS {cublas_us:9.2f}"
                      f"  ratio {cublas_us / us:.3f}"
                      + "".join(f"  {key} {value}" for key, value in checked.items()), flush=True)
    return records


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def _record(check: str, mode: Mode | str, shape: tuple, passed: bool, detail: str) -> dict:
    return {"op": "gemm", "check": check, "mode": str(mode), "shape": list(shape),
            "passed": bool(passed), "detail": detail}


def _position_checks(label: str, n: int, k: int, m: int, mode: Mode) -> list[dict]:
    x, w = _data(m, n, k, seed=1)
    out = gemm(x, w, mode=mode)
    perm = torch.randperm(m, device=DEVICE)
    permuted = gemm(x[perm], w, mode=mode)
    n_perm = int((_bits(permuted) != _bits(out[perm])).sum())
    row = m // 2
    x_other = torch.randn_like(x)
    x_other[row] = x[row]
    n_other = int((_bits(gemm(x_other, w, mode=mode)[row]) != _bits(out[row])).sum())
    return [
        _record("position_permute_rows", mode, (m, n, k), n_perm == 0,
                f"{label}: {n_perm} elements differ after permuting rows"),
        _record("position_replace_other_rows", mode, (m, n, k), n_other == 0,
                f"{label}: row {row}: {n_other} elements differ with other rows replaced"),
    ]


def _rows_differ_across_m(n: int, k: int, small: int, large: int, mode: Mode) -> int:
    """Elements of the first ``small`` rows whose bits differ between M=small and M=large."""
    x, w = _data(large, n, k, seed=2)
    return int((_bits(gemm(x[:small], w, mode=mode)) != _bits(gemm(x, w, mode=mode)[:small])).sum())


def check_invariance_gpu() -> list[dict]:
    """Bitwise checks in bf16 at real shapes; each record says whether it passed and why."""
    _require_cuda()
    shapes = {label: (n, k) for label, n, k in gemm_shapes()}
    labels = ("qwen3-8b.o", "qwen3-8b.qkv", "deepseek-v3.kv_a")
    records: list[dict] = []
    for label in labels:
        n, k = shapes[label]
        for mode in Mode:
            for m in (8, 64, 256):
                records += _position_checks(label, n, k, m, mode)
        # Batch invariance under batch_invariant: rows of M=m equal the same rows at M=2048.
        differing = {m: _rows_differ_across_m(n, k, m, 2048, Mode.BATCH_INVARIANT)
                     for m in (1, 8, 32, 64, 128, 256, 512)}
        bad = {m: d for m, d in differing.items() if d}
        records.append(_record("batch_invariance_vs_m2048", Mode.BATCH_INVARIANT, (2048, n, k),
                               not bad, f"{label}: differing elements per M: {bad or 'none'}"))
    # Negative control: default mode at an M pair whose configs cut K differently (on the H200
    # split-K and stream-K are what reorder a row's sum; BLOCK_K and the tile do not, see the
    # explicit controls below), at the first of these labels, else of every shape, that has one:
    # a re-tune can leave a shape with one reduction order at every M (since mask_rows, no
    # split at small M for qwen3-8b.o). The smaller M is 8 or more where a pair allows: its rows
    # are the ones compared, and a changed fp32 sum flips a bf16 output bit rarely (DESIGN.md:
    # cuBLAS changes ~6 of 4096 elements per row).
    m_values = (1, 8, 32, 64, 128, 256, 512, 2048)
    smaller = sorted(m_values, key=lambda m: (m < 8, m))  # 8, 32, ..., 2048, then 1
    candidates = [(label, *shapes[label]) for label in labels] + list(gemm_shapes())
    found = next(((label, n, k, a, b) for label, n, k in candidates for a in smaller
                  for b in m_values if a < b and _cuts_k(a, n, k) != _cuts_k(b, n, k)), None)
    if found is None:
        records.append(_record("negative_control_default_across_m", Mode.DEFAULT, (8, 0, 0),
                               False, "no shape's default policy cuts K differently across M: "
                               "the control cannot be staged"))
    else:
        label, n, k, small, large = found
        diff = _rows_differ_across_m(n, k, small, large, Mode.DEFAULT)
        records.append(_record(
            "negative_control_default_across_m", Mode.DEFAULT, (large, n, k), diff > 0,
            f"{label}: M={small} (split_k, stream_k) {_cuts_k(small, n, k)} vs M={large} "
            f"{_cuts_k(large, n, k)}: {diff} elements differ (passed = the check can fail)"))
    # At one shape and M: split-K against none is the negative control (passed = the bits
    # changed: the partials regroup the sum); another BLOCK_K alone must keep every bit (passed
    # = none changed), since batch_invariant_tuned picks BLOCK_K by M and relies on Hopper's MMA
    # chaining a K tile's k=16 steps alike at any BLOCK_K (the interpreter's product regroups,
    # so on the CPU the opposite holds: invariance_tests/test_gemm_invariance.py).
    n, k = shapes["qwen3-8b.o"]
    x, w = _data(64, n, k, seed=3)
    base = GemmConfig(64, 64, 32, num_warps=4, num_stages=3)
    ref = _bits(gemm(x, w, config=base))

    def differing(configs: list[GemmConfig]) -> list[int]:
        return [int((_bits(gemm(x, w, config=c)) != ref).sum()) for c in configs]

    split = [dataclasses.replace(base, split_k=s) for s in (2, 4)]
    diffs = differing(split)
    records.append(_record("negative_control_split_k", "explicit", (64, n, k), any(diffs),
                           f"elements differing from {base} for {split}: {diffs} "
                           "(passed = the check can fail)"))
    block_k = [dataclasses.replace(base, block_k=bk) for bk in (64, 128)]
    diffs = differing(block_k)
    records.append(_record("block_k_alone_keeps_row_bits", "explicit", (64, n, k), not any(diffs),
                           f"elements differing from {base} for {block_k}: {diffs} "
                           "(passed = none: what batch_invariant_tuned relies on)"))
    return records


def _cuts_k(m: int, n: int, k: int) -> tuple[int, int]:
    """What of the default policy's config at M orders a row's sum: (split_k, stream-K programs)."""
    config = gemm_config(m, n, k, DTYPE, Mode.DEFAULT, card=device_card(torch.device(DEVICE)))
    return config.split_k, config.stream_k_programs


def summarize(records: list[dict]) -> None:
    """The issue's targets: corun vs cuBLAS at decode M <= 64 and at prefill M."""
    for phase, limit in (("decode", 64), ("prefill", None)):
        ratios = [r["ratio"] for r in records if r["policy"] == "corun" and r["phase"] == phase
                  and (limit is None or r["M"] <= limit)]
        if ratios:
            print(f"corun vs cuBLAS, {phase}{f' M<={limit}' if limit else ''}: "
                  f"min {min(ratios):.3f}, geomean "
                  f"{math.exp(sum(math.log(r) for r in ratios) / len(ratios)):.3f}")


def main(argv: list[str] | None = None) -> int:
    return family_main("gemm", collect, check_invariance_gpu, argv, __doc__.splitlines()[0],
                       summarize)


if __name__ == "__main__":
    sys.exit(main())
