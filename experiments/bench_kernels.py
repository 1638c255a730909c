"""Every kernel against its vendor peer on the GPU, plus the invariance checks at real shapes.

Runs each family's ``collect()`` (timings: ours vs the peer measured in the same run, as a ratio)
and ``check_invariance_gpu()`` (bitwise checks in bf16 at the real shapes), and writes one file
per card, ``experiments/results/kernels-<card>.json`` (``kernels-h200.json``, ``kernels-h100.json``:
``harness.card_tag``; its bounds at that card's copy bandwidth): a header record, then the
timing records ``{"op", "policy", "M", "N", "K", "dtype", "us", "peer", "peer_us", "ratio",
...}``, then the invariance records ``{"op", "check", "mode", "shape", "passed", "detail"}``.
A PNG of the ratios goes beside it.

    python -m experiments.bench_kernels [--quick] [--families gemm,attention,...] [--out DIR]
        [--merge experiments/results/kernels-h200.json]
    python -m experiments.bench_kernels --merge BASE.json --merge-from NEW.json [NEW2.json ...]

``--merge`` folds this run into an earlier file: the ops this run timed or checked replace that
file's records of the same ops, every record keeps the name of the run it came from, and the
header lists each run's command, date and timing method (one device call rarely has the time for
every family). ``--merge-from`` merges files that earlier runs wrote, without running anything.
"""

from __future__ import annotations

import argparse
import importlib
import json
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


def plotted(records: list[dict]) -> list[dict]:
    """The rows the ratio plot draws: those with a ratio, less those whose peer the file marks
    invalid (a peer that timed our own kernel) or whose policy was superseded."""
    return [r for r in records
            if r.get("ratio") and not r.get("peer_invalid") and not r.get("superseded")]


def plot_ratios(records: list[dict], path: Path) -> None:
    """One bar per (op, policy, shape): ratio vs the peer (1.0 = parity)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = plotted(records)
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
        names = sorted({r["peer"] for r in sub})
        peers = ", ".join(names) if len(", ".join(names)) <= 60 else f"{len(names)} configs"
        ax.set_title(f"{op}: peer time / ours (higher is better); peer: {peers}")
        ax.set_xticks(range(len(sub)))
        ax.set_xticklabels(labels, rotation=90, fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def merge_runs(base: list[dict], new: list[dict]) -> list[dict]:
    """``base`` (a merged or single-run file) with ``new``'s ops replaced by ``new``'s records.

    Records carry the run they came from (``run``: ``run<N>`` in the merged header's ``runs``);
    a single-run base becomes ``run1``; runs none of whose records are left drop out of ``runs``.
    The merged header is the newest run's, its command saying that the file is merged."""
    base_head, *base_records = base
    new_head, *new_records = new
    if base_head.get("machine") != new_head.get("machine"):  # one card's figures a file
        raise ValueError(f"merge: a run on {new_head.get('machine')} into a file of "
                         f"{base_head.get('machine')}; each card keeps its own kernels file")
    runs = list(base_head.get("runs") or [])
    if not runs:
        runs = [{key: base_head.get(key) for key in ("command", "date", "families", "timing")}
                | {"run": "run1"} | ({"note": base_head["note"]} if base_head.get("note") else {})]
        base_records = [{**r, "run": r.get("run", "run1")} for r in base_records]
    run_name = f"run{max(int(r['run'].removeprefix('run')) for r in runs) + 1}"
    new_ops = {r["op"] for r in new_records if "op" in r}
    families = new_head.get("families")
    runs.append({"command": new_head.get("command"), "date": new_head.get("date"),
                 "families": families.split(",") if isinstance(families, str) else families,
                 "run": run_name, "timing": new_head.get("timing"),
                 # what was done to the run's records after it (a relabelling), kept with it
                 **({"note": new_head["note"]} if new_head.get("note") else {})})
    kept = [r for r in base_records if r.get("op") not in new_ops]
    live = {r.get("run") for r in kept} | {run_name}
    runs = [run for run in runs if run["run"] in live]  # a run every record replaced is gone
    head = {key: value for key, value in new_head.items()
            if key not in ("families", "quick", "note")}
    head.update(
        command=f"merged from {len(runs)} runs of experiments/bench_kernels.py on the "
                f"{new_head.get('machine')} (bash experiments/run_h200.sh kernels): each op from "
                "its latest run; see runs",
        timing="per run, see runs; each record names its run", runs=runs)
    return [head, *kept, *({**r, "run": run_name} for r in new_records)]


def _merge_files(base_path: Path, new_paths: list[Path], out_dir: str | None) -> Path:
    merged = json.loads(base_path.read_text())
    for path in new_paths:
        merged = merge_runs(merged, json.loads(path.read_text()))
    out = Path(out_dir) if out_dir else base_path.parent
    out.mkdir(parents=True, exist_ok=True)
    path = out / base_path.name  # the merged file keeps its card's name (kernels-h200.json)
    path.write_text(json.dumps(merged, indent=1) + "\n")
    plot_ratios([r for r in merged[1:] if "us" in r], path.with_suffix(".png"))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a handful of shapes per op")
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated subset")
    parser.add_argument("--out", default=None, help="results folder (default experiments/results)")
    parser.add_argument("--merge", type=Path, default=None, metavar="BASE",
                        help="fold this run (or --merge-from files) into BASE's records")
    parser.add_argument("--merge-from", type=Path, nargs="+", default=None, metavar="NEW",
                        help="with --merge: files of earlier runs to fold in; nothing is run")
    args = parser.parse_args(argv)
    if args.merge_from:
        if args.merge is None:
            parser.error("--merge-from needs --merge BASE")
        print(f"wrote {_merge_files(args.merge, args.merge_from, args.out)}")
        return 0

    import torch

    if not torch.cuda.is_available():
        print("bench_kernels needs a CUDA device; none found", file=sys.stderr)
        return 2
    timings, checks, errors = [], [], []
    # With --merge this run's own records go to kernels-<card>-lastrun.json and the merged file
    # is rewritten after every family: a run cut short by its time limit leaves a whole merged
    # file (never this run's records alone under the committed name). A card's records merge
    # into that card's file only.
    card = harness.card_tag()
    if args.merge is not None and not args.merge.name.startswith(f"kernels-{card}."):
        parser.error(f"--merge {args.merge}: this run is on {card}; merge into "
                     f"kernels-{card}.json (or run without --merge for a new file)")
    name = f"kernels-{card}-lastrun" if args.merge is not None else f"kernels-{card}"
    done: list[str] = []  # the header names the families measured so far, not those asked for
    for family in args.families.split(","):
        t, c, e = run_family(family.strip(), args.quick)
        done.append(family.strip())
        timings += t
        checks += c
        errors += e
        path = harness.write_results(
            name,
            timings + checks + [{"error": True, **e} for e in errors],
            args.out,
            quick=args.quick,
            families=",".join(done),
            timing=f"{harness.GRAPH_REPLAY_TIMING}, do_bench where not capturable",
        )
        if args.merge is not None:  # (it plots the merged records)
            path = _merge_files(args.merge, [path], args.out or str(path.parent))
    if args.merge is None:
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
