"""The invariance atlas: which kernels keep a row's bits when what surrounds it changes.

The paper's founding observation is that most kernels are position-invariant but not
batch-invariant. For every case of ``experiments.atlas_cases`` (ours: GEMM, RMSNorm, SiLU-mul,
RoPE, prefill and decode attention, the MoE layer, sampling, each in every policy; vendor: cuBLAS
matmul, SDPA's flash / efficient / cuDNN / math backends, ``F.rms_norm``, softmax, a torch
per-expert MoE loop), one row r (id 0) is compared bit for bit across:

- (a) **other rows**: the same batch size, the other rows' contents changed (set A vs set B);
- (b) **row index**: the same rows, r moved from slot 0 to the last slot;
- (c) **batch size**: r alone vs r with 1 .. max(sizes) - 1 co-runners (every size listed);
- (d) **run to run**: the same batch twice (the whole output compared).

Each check records the count of changed elements (of ``row_elements``, or of the whole output
for (d)). Position invariance is (a) and (b) at 0; batch invariance is (c) at 0 as well. The
all-reduce (``experiments.atlas_all_reduce``) runs on one NCCL rank per GPU where at least two
are visible, on 4 gloo CPU ranks in the dry run, and is a ``skipped`` record on one GPU.

Writes ``experiments/results/<--name>.json`` (header + one record per case, rewritten after
each) and renders as the README's atlas table (``experiments.report``). ``--time-budget-s``
skips the cases that would start after it. ``--dry-run``: the same cases at tiny shapes, fp32,
on the CPU through the Triton interpreter (seconds; CI).

    python -m experiments.invariance_atlas                 # H200, < 3 min
    python -m experiments.invariance_atlas --dry-run --ops gemm rmsnorm
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from tqdm.auto import tqdm

from experiments.harness import write_results

OTHERS_A, OTHERS_B = 1, 100_000  # first ids of the two co-runner sets (row r is id 0)


def diff_count(a: torch.Tensor, b: torch.Tensor) -> int:
    """Elements whose bits differ (NaNs with equal bits count as equal)."""
    if a.shape != b.shape:
        return max(a.numel(), b.numel())
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return int((a.contiguous().view(ints) != b.contiguous().view(ints)).sum())


def check_case(case) -> dict:
    """The four checks of one case; each run's rows come from ids only (``Bank``)."""
    m = case.batch
    others_a = list(range(OTHERS_A, OTHERS_A + max(m, *case.sizes)))
    others_b = list(range(OTHERS_B, OTHERS_B + m))
    first = case.run([0, *others_a[:m - 1]])
    own = first[0]
    other_rows = diff_count(own, case.run([0, *others_b[:m - 1]])[0])
    moved = case.run([*others_a[:m - 1], 0])
    row_index = diff_count(own, moved[m - 1])
    alone = case.run([0])[0]
    by_size = {str(n): diff_count(alone, own if n == m else case.run([0, *others_a[:n - 1]])[0])
               for n in case.sizes if n > 1}
    again = case.run([0, *others_a[:m - 1]])
    run_to_run = sum(diff_count(x, y) for x, y in zip(first, again, strict=True))
    return {"other_rows": other_rows, "row_index": row_index,
            "batch_size": max(by_size.values(), default=0), "batch_size_by_m": by_size,
            "batch_sizes_changed": [int(n) for n, c in by_size.items() if c],
            "run_to_run": run_to_run, "row_elements": own.numel(),
            "run_to_run_elements": sum(x.numel() for x in first),
            "position_invariant": other_rows == 0 and row_index == 0,
            "batch_invariant": other_rows == 0 and row_index == 0 and not any(by_size.values()),
            "deterministic": run_to_run == 0}


def case_record(case) -> dict:
    """One case's record: what it is, its four checks (or the error that stopped it), seconds."""
    record = {"op": case.op, "impl": case.impl, "policy": case.policy, "shape": case.shape,
              "batch": case.batch, "sizes": list(case.sizes)}
    start = time.perf_counter()
    try:
        with torch.inference_mode():
            record.update(check_case(case))
    except Exception as exc:  # a backend that cannot run the shape: say so, go on
        record["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    record["seconds"] = round(time.perf_counter() - start, 2)
    return record


def _show(record: dict) -> None:
    tqdm.write(json.dumps({k: v for k, v in record.items() if k != "batch_size_by_m"}))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny shapes, fp32, CPU (Triton interpreter)")
    parser.add_argument("--ops", nargs="*", default=None, help="only these ops (default all)")
    parser.add_argument("--impls", nargs="*", default=None,
                        help="only implementations containing one of these words")
    parser.add_argument("--time-budget-s", type=float, default=150.0)
    parser.add_argument("--name", default=None)
    args = parser.parse_args(argv)
    # Native on a GPU unless the interpreter is on (then the CPU); tiny shapes on the CPU or
    # with --dry-run (on a GPU machine the dry run runs natively, as the kernel tests do).
    native = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
    if not native:  # before any kernel module imports triton
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device = torch.device("cuda" if native else "cpu")
    tiny = args.dry_run or not native
    name = args.name or ("invariance-atlas-h200" if not tiny
                         else f"invariance-atlas-{device.type}-dry-run")
    from experiments.atlas_cases import REAL, TINY, all_cases

    t0 = time.perf_counter()
    cases = [c for c in all_cases(device, tiny=tiny)
             if (args.ops is None or c.op in args.ops)
             and (args.impls is None or any(w in c.impl for w in args.impls))]
    sizes = TINY if tiny else REAL
    extra = {"shapes": {k: (str(v) if isinstance(v, torch.dtype) else v)
                        for k, v in sizes.items()},
             "checks": {"other_rows": "(a) same batch size, the other rows' contents changed",
                        "row_index": "(b) the row moved from slot 0 to the last slot",
                        "batch_size": "(c) alone vs with co-runners, max over batch_size_by_m",
                        "run_to_run": "(d) the same batch twice, whole output"}}
    records: list[dict] = []
    if args.ops is None or "all_reduce" in args.ops:
        from experiments.atlas_all_reduce import all_reduce_records

        records += all_reduce_records(native, tiny)
        for record in records:
            _show(record)
    skipped: list[str] = []
    for case in tqdm(cases, desc="atlas", unit="case"):
        label = f"{case.op} {case.impl} {case.policy}"
        if time.perf_counter() - t0 > args.time_budget_s:
            skipped.append(label)
            continue
        record = case_record(case)
        records.append(record)
        _show(record)
        path = write_results(name, records, **extra, skipped=skipped)
    path = write_results(name, records, **extra, skipped=skipped)
    print(f"wrote {path} in {time.perf_counter() - t0:.0f} s"
          + (f"; time budget spent, skipped {len(skipped)} cases" if skipped else ""))


if __name__ == "__main__":
    main()
