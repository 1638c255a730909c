"""``python -m experiments.ablate serving-load``: the load axis, over HTTP.

One ``corun.serve`` per mode (``experiments.bench_serving --launch``: warm-up requests, then
Poisson arrivals at each rate, streaming, vLLM's record format), rates from 1 req/s up to
saturation (``inf``: every request at t=0, the server's own throughput limit). Writes
``experiments/results/ablate-serving-load-h200.json`` (bench_serving's records) and a PNG of
output tok/s, TTFT p50 and TPOT p50 against the rate, one line per mode. The budget
(``--time-budget-s``) is split over the modes and rates by bench_serving and cuts each run's
request count to fit; server start-ups come on top (about a minute each at the Qwen3-8B shape).
``--modes default --rates inf --merge EARLIER`` runs one mode at the rates given and keeps every
other point of an earlier file (a point: a mode at a rate), at the earlier run's budget per point
(its ``--time-budget-s`` over its modes and rates, whatever this run's flag says), so every point
sends the same number of requests and the curves compare.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from experiments import bench_serving
from experiments.harness import RESULTS_DIR

SERVING_MODES = ("corun", "batch_invariant_tuned", "batch_invariant", "default")
DRY_RUN = dict(modes=("corun",), rates="4,inf", server_args="--device cpu --dtype float32 "
               "--max-num-seqs 4 --max-model-len 128", input_len=16, output_len=4, num_prompts=4,
               warmup_requests=1)


def budget_per_point_s(head: dict) -> float | None:
    """The budget each point (a mode at a rate) of a serving-load file ran at: its header's
    ``budget_per_point_s`` (a merged file's, whose own run may have measured one point), else
    its ``--time-budget-s`` over its modes and rates; None where the header says neither."""
    if head.get("budget_per_point_s"):
        return float(head["budget_per_point_s"])
    args = head.get("args", {})
    budget, modes, rates = (args.get(k) for k in ("time_budget_s", "modes", "request_rate"))
    if budget in (None, "None") or not modes or not rates:
        return None
    return float(budget) / (len(modes.split(",")) * len(str(rates).strip("[]").split(",")))


def merged_budget_s(earlier_head: dict, num_modes: int, num_rates: int) -> float | None:
    """This run's budget when it joins an earlier file: the earlier budget per point times this
    run's modes and rates (bench_serving splits a budget evenly over them), or None when the
    earlier header does not say it."""
    per_point = budget_per_point_s(earlier_head)
    return None if per_point is None else per_point * num_modes * num_rates


def point_key(record: dict) -> tuple:
    """A serving-load point: one mode at one rate (and concurrency cap)."""
    return record.get("mode"), str(record.get("request_rate")), record.get("max_concurrency")


def merged_records(earlier: list[dict], records: list[dict]) -> tuple[list[dict], int]:
    """The earlier file's points this run did not measure, then this run's; and how many were
    kept. A run of one mode at some rates keeps that mode's other rates; an earlier record of a
    server that did not start (an error, no rate) goes when this run ran its mode."""
    ran = {point_key(r) for r in records}
    ran_modes = {r.get("mode") for r in records}
    kept = [r for r in earlier if not r.get("header") and point_key(r) not in ran
            and not ("error" in r and r.get("mode") in ran_modes)]
    return kept + records, len(kept)


def serving_argv(args: argparse.Namespace, out_dir: Path, name: str | None = None) -> list[str]:
    dry = DRY_RUN if args.dry_run else {}
    modes = args.modes or dry.get("modes", SERVING_MODES)
    if not set(modes) <= set(SERVING_MODES):  # a server runs one engine mode, no variants
        raise ValueError(f"modes: serving-load runs {', '.join(SERVING_MODES)}, got {modes}")
    return ["--launch", "--model", args.model, "--modes", ",".join(modes),
            "--server-args", dry.get("server_args", args.server_args),
            "--request-rate", dry.get("rates", args.rates),
            "--random-input-len", str(dry.get("input_len", 1024)),
            "--random-output-len", str(dry.get("output_len", 256)),
            "--num-prompts", str(dry.get("num_prompts", args.num_requests)),
            "--warmup-requests", str(dry.get("warmup_requests", 32)),
            "--time-budget-s", str(args.time_budget_s), "--seed", str(args.seed),
            "--result-name", name or args.name, "--result-dir", str(out_dir)]


def serving_load(args: argparse.Namespace) -> None:
    out_dir = Path(os.environ.get("CORUN_RESULTS_DIR", RESULTS_DIR))
    if args.dry_run:
        args.model = "tiny-qwen3"
    path = out_dir / f"{args.name}.json"
    earlier_head, earlier = None, []
    if args.merge is not None:
        if args.merge.resolve() == path.resolve():  # the merged file replaces its own source
            raise ValueError(f"--merge {args.merge}: this run writes its merged file there; "
                             "pass --name (or CORUN_RESULTS_DIR) for another output file")
        earlier_head, *earlier = json.loads(args.merge.read_text())
        dry = DRY_RUN if args.dry_run else {}
        num_modes = len(args.modes or dry.get("modes", SERVING_MODES))
        num_rates = len(dry.get("rates", args.rates).split(","))
        budget = merged_budget_s(earlier_head, num_modes, num_rates)
        if budget is None:
            print(f"--merge: {args.merge.name}'s header has no budget, modes and rates; this "
                  f"run's {args.time_budget_s:.0f} s may send other request counts", flush=True)
        elif budget != args.time_budget_s:
            print(f"--merge: budget {budget:.0f} s ({args.merge.name}'s per mode and rate x "
                  f"{num_modes} x {num_rates}), not {args.time_budget_s:.0f} s", flush=True)
            args.time_budget_s = budget
    # A merging run writes its own records under another name as it goes, and the merged file
    # only once it finished: a run cut short never leaves a file of the merged name that lacks
    # the earlier run's modes.
    run_path = path if earlier_head is None else out_dir / f"{args.name}-unmerged.json"
    bench_serving.main(serving_argv(args, out_dir, run_path.stem))
    head, *records = json.loads(run_path.read_text())
    head["budget_per_point_s"] = budget_per_point_s(head)  # what a later merge runs at
    if earlier_head is not None:  # an earlier run's points that this one did not run
        records, num_kept = merged_records(earlier, records)
        head["merged"] = {"from": args.merge.name, "date": earlier_head.get("date"),
                          "command": earlier_head.get("command"), "points_kept": num_kept}
    path.write_text(json.dumps([head, *records], indent=1) + "\n")
    plot(records, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png')}")


def plot(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [r for r in records if "error" not in r]  # a server that did not start
    rates = sorted({r["request_rate"] for r in records},
                   key=lambda r: float("inf") if r == "inf" else float(r))
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for mode in dict.fromkeys(r["mode"] for r in records):
        rows = sorted((r for r in records if r["mode"] == mode and r.get("max_concurrency")
                       is None), key=lambda r: rates.index(r["request_rate"]))
        xs = [rates.index(r["request_rate"]) for r in rows]
        for ax, key in zip(axes, ("output_throughput", "median_ttft_ms", "median_tpot_ms"),
                           strict=True):
            ax.plot(xs, [r.get(key) or 0 for r in rows], "o-", label=mode)
    for ax, label in zip(axes, ("output tok/s", "TTFT p50 (ms)", "TPOT p50 (ms)"), strict=True):
        ax.set_xticks(range(len(rates)), [str(r) for r in rates])
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("ablation: serving load (Poisson arrivals; inf = all at once)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
