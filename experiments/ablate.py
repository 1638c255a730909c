"""One ablation a command: ``python -m experiments.ablate AXIS``, all other settings at defaults.

Axes (``experiments.ablate_axes``): ``decode-batch``, ``decode-split-size``, ``cuda-graphs``,
``prefill-policy``, ``prefill-chunk``, ``prefill-step-tokens``, ``stall-budget``, ``overlap``,
``kernel-policy``, each run in every mode it applies to; and ``serving-load`` (Poisson rates from
1 req/s to saturation through ``experiments.bench_serving --launch``, one server per mode).

The offline axes run ``bench_offline``'s workload (Qwen3-8B shape, random bf16 weights, input
lengths uniform in [256, 2048], 256 output tokens, all requests at t=0; 200 requests by default)
on one set of weights: per point a warm-up of every shape, the timed run (output tok/s, TTFT,
TPOT, per-step profile) and the fingerprint audit (``--audit-requests`` rescheduled at half the
point's concurrency and ``--alone-sample`` alone; ``mismatches`` against the timed run). Points
that differ only in scheduling share one ModelRunner (graphs captured once); a runner is
destroyed before the next is built (``sweep_offline.release_runner``), so its KV memory is free.

``kernel-policy`` separates the kernels from the schedule: corun's schedule (fixed shapes) with
each kernel policy, beside each peer mode under its own dynamic schedule. The engine ties the
kernel policy to the mode, so the corun-schedule points run a runner whose ``OpsConfig.mode`` is
set to the policy before anything is captured (``KernelPolicyRunner``).

Writes ``experiments/results/ablate-<axis>-h200.json`` after every point (header: axis, values,
modes, workload) and a PNG beside it: throughput and TPOT p50 against the axis, mismatches
annotated. ``--time-budget-s`` skips the points that would start after it (listed in the header).
``--merge EARLIER`` keeps an earlier file's points that this run does not re-run.
``--repeats N`` times each point N times and keeps its median run, with every run's throughput
in the record (``output_tok_s_runs``, error bars in the PNG): one run's ~5% spread on the H200 is
as large as most of the effects measured.

    python -m experiments.ablate decode-split-size            # H200
    python -m experiments.ablate stall-budget --modes corun --values 2048 8192
    python -m experiments.ablate overlap --dry-run            # CPU, tiny-qwen3, seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from tqdm.auto import tqdm

from corun.config import EngineConfig
from corun.model_runner import ModelRunner
from experiments import ablate_axes, bench_offline
from experiments.harness import card_tag, write_results
from experiments.offline_workload import make_workload
from experiments.sweep_offline import measure_point, release_runner
from kernels.mode import Mode

DRY_RUN_ARGS = dict(model="tiny-qwen3", device="cpu", dtype="float32", num_requests=6,
                    input_len=(8, 40), output_len=3, max_num_seqs=4, max_num_batched_tokens=128,
                    audit_requests=3, alone_sample=1, warmup_burst=4,
                    corun_set=["prefill_step_tokens=128", "prefill_chunk_size=32",
                               "prefill_token_budget=128"])


class KernelPolicyRunner(ModelRunner):
    """A runner whose kernels follow ``kernel_policy`` whatever the config's mode (which still
    drives the scheduler): the ops are replaced before the graphs are captured, and stay."""

    def __init__(self, config: EngineConfig, model: tuple, kernel_policy: str) -> None:
        self._kernel_policy = Mode.parse(kernel_policy, "kernel_policy")
        super().__init__(config, model=model)
        self.ops = dataclasses.replace(self.ops, mode=self._kernel_policy)  # eager steps

    def capture_graphs(self) -> None:
        self.ops = dataclasses.replace(self.ops, mode=self._kernel_policy)
        super().capture_graphs()


def point_config(point: ablate_axes.Point, args: argparse.Namespace) -> EngineConfig:
    return dataclasses.replace(bench_offline.engine_config(point.variant, args), **point.fields)


def runner_key(config: EngineConfig, point: ablate_axes.Point) -> tuple:
    # Only the stall budget is the scheduler's alone; every other field may size the runner.
    return dataclasses.replace(config, prefill_token_budget=1), point.kernel_policy


def run_point(point, config, runner, model, work, args) -> dict:
    # A point's figures are its median run of ``--repeats`` (the lower median for an even count),
    # every run's throughput beside them: run-to-run spread on the H200 is ~5%, as large as most
    # of the effects measured.
    runs = []
    for repeat in range(args.repeats):
        label = point.label if args.repeats == 1 else f"{point.label} run {repeat + 1}"
        _, finals, measured = measure_point(config, runner, work, args, label)
        runs.append((measured, finals))
    ordered = sorted(runs, key=lambda run: run[0]["output_tok_s"])
    measured, finals = ordered[(len(ordered) - 1) // 2]
    record = {"axis": args.axis, "value": point.value, "series": point.series,
              "variant": point.variant, "engine_mode": config.kernel_mode.value,
              "kernel_policy": point.kernel_policy or config.kernel_mode.value, **measured,
              "config": bench_offline.config_record(config, runner)}
    if args.repeats > 1:
        throughputs = [run[0]["output_tok_s"] for run in runs]
        record["output_tok_s_runs"] = throughputs
        record["output_tok_s_spread"] = round(max(throughputs) / min(throughputs) - 1, 4)
    if not args.no_audit:
        audit_args = argparse.Namespace(**{**vars(args), "audit_max_num_seqs": max(
            1, config.max_num_seqs // 2)})
        record.update(bench_offline.audit(runner, config, work, finals, audit_args))
    return record


def offline_axis(args: argparse.Namespace) -> None:
    from models import build_model

    t0 = time.perf_counter()
    plan = ablate_axes.points(args.axis, args.modes, args.values, args.dry_run, args.max_num_seqs)
    probe = point_config(plan[0], args)
    model = build_model(args.model, dtype=probe.torch_dtype, device=probe.resolved_device,
                        seed=args.seed)
    work = make_workload(args.num_requests, args.input_len, args.output_len,
                                       model[1].vocab_size, args.seed)
    extra = {"axis": args.axis, "what": ablate_axes.AXES[args.axis].what, "model": args.model,
             "dtype": args.dtype, "values": [p.value for p in plan],
             "series": list(dict.fromkeys(p.series for p in plan)),
             "workload": {"num_requests": args.num_requests, "input_len": list(args.input_len),
                          "output_len": args.output_len, "max_num_seqs": args.max_num_seqs,
                          "arrivals": "all at t=0", "corun_overrides": args.corun_overrides},
             "repeats": args.repeats,
             "timing": "wall clock of each point's run after its warm-up; per-step profile with "
                       "a device sync around each step"
                       + ("" if args.repeats == 1 else
                          f"; figures from the median of {args.repeats} timed runs, each run's "
                          "output tok/s in output_tok_s_runs")}
    records, merged = merged_records(args.merge, plan)
    if merged:
        extra["merged"] = merged
    skipped: list[str] = []
    runner, key, path = None, None, None
    for point in tqdm(plan, desc=f"ablate {args.axis}", unit="point"):
        if time.perf_counter() - t0 > args.time_budget_s:
            skipped.append(point.label)
            continue
        config = point_config(point, args)
        try:
            if runner_key(config, point) != key:
                release_runner(runner)
                runner, key = None, None
                runner = (KernelPolicyRunner(config, model, point.kernel_policy)
                          if point.kernel_policy else ModelRunner(config, model=model))
                key = runner_key(config, point)
            record = run_point(point, config, runner, model, work, args)
        except Exception as exc:  # one point failing (out of memory, a bad value) keeps the rest
            release_runner(runner)
            runner, key = None, None
            record = {"axis": args.axis, "value": point.value, "series": point.series,
                      "variant": point.variant, "error": f"{type(exc).__name__}: {exc}"[:500]}
        records.append(record)
        print(json.dumps(record), flush=True)
        path = write_results(args.name, records, **extra, skipped=skipped)
        ablate_axes.plot(args.axis, records, path.with_suffix(".png"))
    release_runner(runner)
    path = write_results(args.name, records, **extra, skipped=skipped)
    if skipped:
        print(f"time budget spent: skipped {', '.join(skipped)}", flush=True)
    print(f"wrote {path} in {time.perf_counter() - t0:.0f} s")


def merged_records(path, plan: list[ablate_axes.Point]) -> tuple[list[dict], dict | None]:
    """The points of an earlier results file of the same axis that this run does not re-run
    (matched by series and value), and where they came from, for the header."""
    if path is None:
        return [], None
    old = json.loads(path.read_text())
    header = next((r for r in old if r.get("header")), {})
    rerun = {(p.series, json.dumps(p.value)) for p in plan}
    kept = [r for r in old if not r.get("header")
            and (r.get("series"), json.dumps(r.get("value"))) not in rerun]
    return kept, {"from": path.name, "date": header.get("date"),
                  "command": header.get("command"), "points_kept": len(kept)}


def parse_value(text: str) -> object:
    return bench_offline.parse_overrides([f"v={text}"])["v"]


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = bench_offline.build_parser()
    parser.description = __doc__.split("\n")[0]
    parser.add_argument("axis", choices=[*ablate_axes.AXES, "serving-load"])
    parser.add_argument("--values", nargs="+", type=parse_value, default=None,
                        help="the axis's values (default: the axis's own list)")
    parser.add_argument("--dry-run", action="store_true", help="CPU smoke: tiny-qwen3")
    parser.add_argument("--repeats", type=_positive_int, default=1,
                        help="timed runs per point: its figures from the median run, the spread "
                             "recorded (the audit runs once)")
    parser.add_argument("--merge", type=Path, default=None, metavar="EARLIER",
                        help="keep the points of an earlier results file of this axis that this "
                             "run does not re-run (the header names the file, its date and "
                             "command)")
    parser.add_argument("--time-budget-s", type=float, default=480.0,
                        help="points that would start after this are skipped")
    parser.add_argument("--rates", default="1,2,4,8,16,32,inf",
                        help="serving-load: request rates (req/s), inf = all at once")
    parser.add_argument("--server-args", default="--max-num-seqs 64 --decode-batch-size 64 "
                        "--max-model-len 4096", help="serving-load: corun.serve flags")
    parser.set_defaults(modes=None, num_requests=200, audit_requests=32, alone_sample=2,
                        name=None)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.dry_run:  # the dry run's sizes, unless given on the command line
        parser.set_defaults(**DRY_RUN_ARGS, time_budget_s=120.0)
        args = parser.parse_args(argv)
    args.name = args.name or f"ablate-{args.axis}-{'cpu-dry-run' if args.dry_run else card_tag()}"
    args.input_len = tuple(args.input_len)
    args.corun_overrides = bench_offline.parse_overrides(args.corun_set)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.axis == "serving-load":
        from experiments.ablate_serving import serving_load

        serving_load(args)
    else:
        offline_axis(args)


if __name__ == "__main__":
    main()
