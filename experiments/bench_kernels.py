"""Every kernel against its vendor peer on the H200, plus the invariance checks at real shapes.

Runs each family's ``collect()`` (timings: ours vs the peer measured in the same run, as a ratio)
and ``check_invariance_gpu()`` (bitwise checks in bf16 at the real shapes), and writes one file,
``experiments/results/kernels-h200.json``: a header record, then the timing records
``{"op", "policy", "M", "N", "K", "dtype", "us", "peer", "peer_us", "ratio", ...}``, then the
invariance records ``{"op", "check", "mode", "shape", "passed", "detail"}``. A PNG of the ratios
goes beside it.

    python -m experiments.bench_kernels [--quick] [--families gemm,attention,...] [--out DIR]
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
import traceback
from pathlib import Path

from experiments import harness

FAMILIES = ("gemm", "elementwise", "sampling", "attention", "mla", "moe")


def run_family(name: str, quick: bool) -> tuple[list[dict], list[dict], list[dict]]:
    """(timings, invariance checks, errors) of one family; a failing family never stops the rest."""
    timings, checks, errors = [], [], []
    try:
        module = importlib.import_module(f"experiments.bench_{name}")
    except Exception as exc:  # a missing or broken module is recorded, not hidden
        return [], [], [{"family": name, "stage": "import", "error": repr(exc)}]
    for stage, fn, sink in (
        ("collect", lambda: module.collect(quick=quick), timings),
        ("invariance", module.check_invariance_gpu, checks),
    ):
        start = time.perf_counter()
        try:
            sink.extend(fn())
        except Exception as exc:
            errors.append(
                {
                    "family": name,
                    "stage": stage,
                    "error": repr(exc),
                    "traceback": traceback.format_exc()[-2000:],
                }
            )
        print(f"[{name}] {stage}: {time.perf_counter() - start:.1f}s", flush=True)
    return timings, checks, errors


def plot_ratios(records: list[dict], path: Path) -> None:
    """One bar per (op, policy, shape): ratio vs the peer (1.0 = parity)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in records if r.get("ratio")]
    if not rows:
        return
    ops = sorted({r["op"] for r in rows})
    fig, axes = plt.subplots(len(ops), 1, figsize=(14, 3.2 * len(ops)), squeeze=False)
    for ax, op in zip(axes[:, 0], ops, strict=True):
        sub = [r for r in rows if r["op"] == op]
        labels = [f"{r['policy'][:4]} M{r['M']} N{r['N']} K{r['K']}" for r in sub]
        ax.bar(
            range(len(sub)),
            [r["ratio"] for r in sub],
            color=["tab:blue" if r["policy"] == "corun" else "tab:gray" for r in sub],
        )
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_title(f"{op}: peer time / ours (higher is better); peer = {sub[0]['peer']}")
        ax.set_xticks(range(len(sub)))
        ax.set_xticklabels(labels, rotation=90, fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a handful of shapes per op")
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated subset")
    parser.add_argument("--out", default=None, help="results folder (default experiments/results)")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("bench_kernels needs a CUDA device; none found", file=sys.stderr)
        return 2
    timings, checks, errors = [], [], []
    for name in args.families.split(","):
        t, c, e = run_family(name.strip(), args.quick)
        timings += t
        checks += c
        errors += e
        # Written after every family, so a run cut short by its time limit still leaves a file.
        path = harness.write_results(
            "kernels-h200",
            timings + checks + [{"error": True, **e} for e in errors],
            args.out,
            quick=args.quick,
            families=args.families,
            timing="harness.bench_us: CUDA-graph replay medians, do_bench where not capturable",
        )
    plot_ratios(timings, path.with_suffix(".png"))
    failed = [c for c in checks if not c.get("passed") and not c.get("negative_control")]
    print(
        f"wrote {path}: {len(timings)} timings, {len(checks)} checks "
        f"({len(failed)} failed), {len(errors)} errors"
    )
    for e in errors:
        print("ERROR", e["family"], e["stage"], e["error"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
