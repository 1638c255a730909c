"""Sweep corun's scheduling settings (and the dynamic peers' token budget) on the offline workload.

Each point is one engine config run on the same workload and weights as ``bench_offline`` (a
smaller request count by default), after the same warm-up; it records output tokens/s, TTFT and
TPOT percentiles and the per-step profile. Points that share their fixed shapes (mode, B, T, R,
C, policy) share one ModelRunner, so the graphs are captured once per shape set. The shipped
defaults of ``EngineConfig`` are chosen from this sweep (the README says which point).

Axes around a base point (packed prefill, C = 512, T = 2048, R = 32, budget T, no overlap,
B = max_num_seqs): the packed step T, the chunk size C, the budget, overlap, the isolated policy,
and B; plus ``default`` and ``batch_invariant_tuned`` at two token budgets (the peers' own best).
Writes ``experiments/results/<--name>.json`` after every point and a PNG of throughput and TPOT
per point.

    python -m experiments.sweep_offline                      # H200, Qwen3-8B shape
    python -m experiments.sweep_offline --model tiny-qwen3 --device cpu --dtype float32 \\
        --num-requests 8 --input-len 8 40 --output-len 4 --max-num-seqs 4 --dry-run
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import time
from pathlib import Path

import torch

from corun.config import ENGINE_DEFAULTS, EngineConfig
from corun.engine import LLMEngine
from corun.model_runner import ModelRunner
from experiments.bench_offline import non_negative_int, timed_run, warm_up
from experiments.harness import write_results
from experiments.offline_stats import latency_stats, step_profile
from experiments.offline_workload import make_workload

# The decode split size is baked into the captured graphs, so it keys the runner too.
RUNNER_FIELDS = ("mode", "decode_batch_size", "prefill_policy", "prefill_chunk_size",
                 "prefill_step_tokens", "max_prefill_seqs_per_step", "max_num_batched_tokens",
                 "max_num_seqs", "overlap_prefill_decode",  # overlap sizes the workspace
                 "decode_split_size")


def release_runner(runner: ModelRunner | None) -> None:
    """Free a runner's KV cache, graphs and buffers before the next one is built (an engine
    still referring to it no longer pins them); the shared weights stay."""
    if runner is None:
        return
    cuda = runner.device.type == "cuda"
    runner.destroy()
    del runner
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def measure_point(config: EngineConfig, runner: ModelRunner, work, args: argparse.Namespace,
                  label: str) -> tuple[LLMEngine, dict, dict]:
    """One point on ``runner``: warm-up, then the whole workload timed with a per-step profile.
    Returns (engine, index -> final output, record of throughput, latency and profile)."""
    # Warm up on an engine of its own: with prefix caching on, the warm-up's burst would leave
    # the first requests' prompts cached for the timed run.
    warm_up(LLMEngine(config, model_runner=runner), work, args)
    main = timed_run(config, runner, work, list(range(len(work.prompts))), label,
                     args.reruns_if_compiled)
    engine, finals, seconds = main.engine, main.finals, main.seconds
    outputs = list(finals.values())
    record = {"output_tok_s": round(sum(len(o.token_ids) for o in outputs) / seconds, 2),
              "wall_s": round(seconds, 3), **latency_stats(outputs),
              **main.compile_fields(),
              "num_preemptions": engine.stats()["num_preemptions"],
              **step_profile(engine.step_records, runner)}
    return engine, finals, record


def grid(b: int, dry_run: bool) -> list[tuple[str, dict]]:
    """(label, EngineConfig fields) of every point."""
    scale = 16 if dry_run else 1  # tiny models on the CPU: the same grid, 16x smaller steps
    c, t = 512 // scale, 2048 // scale
    base = dict(mode="corun", prefill_policy="packed", prefill_chunk_size=c,
                prefill_step_tokens=t, max_prefill_seqs_per_step=32, prefill_token_budget=t,
                overlap_prefill_decode=False, decode_batch_size=b)
    points = [("base", base)]
    for step in (t // 2, 2 * t):
        points.append((f"T={step}", dict(base, prefill_step_tokens=step,
                                         prefill_token_budget=step)))
    # The larger step with more prefill between decode steps (its own T as the unit), with and
    # without overlap: the corners the single-axis points above point towards.
    for mult in (2, 4):
        points.append((f"T={2 * t},budget={mult}T", dict(base, prefill_step_tokens=2 * t,
                                                        prefill_token_budget=2 * mult * t)))
    points.append((f"T={2 * t},overlap,budget=2T", dict(
        base, prefill_step_tokens=2 * t, prefill_token_budget=4 * t, overlap_prefill_decode=True)))
    # corun's decode attention split (tokens per split, fixed per config): larger splits write
    # and combine fewer fp32 partials, which matters at B in the hundreds.
    for split in (512, 1024):
        points.append((f"T={2 * t},split={split}", dict(
            base, prefill_step_tokens=2 * t, prefill_token_budget=2 * t, decode_split_size=split)))
    points.append((f"T={4 * t}", dict(base, prefill_step_tokens=4 * t,
                                      prefill_token_budget=4 * t)))
    # Chunk size at the larger step: a chunk never cut to fill a step leaves up to C - 1 slots
    # of it padded (10% at C=512, T=4096 in the headline), so smaller chunks pad less, at more
    # rows (hence the row cap with them) and more attention passes over a prompt's prefix.
    for chunk, rows in ((c // 4, 64), (c // 2, 32), (c // 2, 64), (2 * c, 32)):
        points.append((f"T={2 * t},C={chunk},rows={rows}", dict(
            base, prefill_step_tokens=2 * t, prefill_token_budget=2 * t,
            prefill_chunk_size=chunk, max_prefill_seqs_per_step=rows, decode_split_size=512)))
    # Smaller steps at the shipped chunk and row cap: under a serving load each arrival gets a
    # packed step of its own, so T is what one arrival costs the decode batch.
    for step in (t // 2, t):
        points.append((f"T={step},C={c // 2},rows=64", dict(
            base, prefill_step_tokens=step, prefill_token_budget=step, prefill_chunk_size=c // 2,
            max_prefill_seqs_per_step=64, decode_split_size=512)))
    points.append((f"T={4 * t},C={c // 2},rows=64", dict(
        base, prefill_step_tokens=4 * t, prefill_token_budget=4 * t, prefill_chunk_size=c // 2,
        max_prefill_seqs_per_step=64, decode_split_size=512)))
    for chunk in (c // 2, 2 * c):
        points.append((f"C={chunk}", dict(base, prefill_chunk_size=chunk)))
    for mult in (2, 4):
        points.append((f"budget={mult}T", dict(base, prefill_token_budget=mult * t)))
    for mult in (1, 2):
        points.append((f"overlap,budget={mult}T", dict(base, overlap_prefill_decode=True,
                                                       prefill_token_budget=mult * t)))
    points.append(("overlap,T=2T", dict(base, overlap_prefill_decode=True,
                                        prefill_step_tokens=2 * t, prefill_token_budget=2 * t)))
    for chunk in (c, 4 * c):
        points.append((f"isolated,C={chunk}", dict(base, prefill_policy="isolated",
                                                   prefill_chunk_size=chunk,
                                                   prefill_token_budget=4 * c)))
    points.append((f"B={b // 2}", dict(base, decode_batch_size=b // 2)))
    for mode in ("default", "batch_invariant_tuned"):
        for budget in (4096 // scale, 8192 // scale):
            points.append((f"{mode},tokens={budget}", dict(mode=mode,
                                                           max_num_batched_tokens=budget)))
    return points


SCHEDULING_FIELDS = ("decode_batch_size", "prefill_policy", "prefill_chunk_size",
                     "prefill_step_tokens", "max_prefill_seqs_per_step", "prefill_token_budget",
                     "overlap_prefill_decode", "decode_split_size")


def best_corun_settings(runs: list[list[dict]]) -> list[str]:
    """``KEY=VALUE`` overrides (bench_offline ``--corun-set``) of the corun point with the highest
    output tokens/s relative to ``default`` in its own run: each run's records carry a default
    point, so runs of other request counts or machines compare as ratios to their own peer."""
    scored = []
    for records in runs:
        peers = [r["output_tok_s"] for r in records if r["config"]["mode"] == "default"]
        if not peers:
            raise ValueError("runs: every sweep file needs a default point to compare against")
        scored += [(r["output_tok_s"] / max(peers), r) for r in records
                   if r["config"]["mode"] == "corun"]
    if not scored:
        raise ValueError("runs: no corun point to choose from")
    best = max(scored, key=lambda pair: pair[0])[1]
    def text(value) -> str:  # bench_offline's parse_overrides reads true / false
        return str(value).lower() if isinstance(value, bool) else str(value)

    def value(field: str):  # points recorded before a field was swept ran at its default
        return best["config"].get(field, ENGINE_DEFAULTS[field])

    return [f"{field}={text(value(field))}" for field in SCHEDULING_FIELDS]


def plot(records: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["point"] for r in records]
    fig, axes = plt.subplots(2, 1, figsize=(12, 6.5), sharex=True)
    colors = ["#3366cc" if r["config"]["mode"] == "corun" else "#aa3333" for r in records]
    axes[0].bar(labels, [r["output_tok_s"] for r in records], color=colors)
    axes[0].set_ylabel("output tokens/s")
    axes[1].bar(labels, [r.get("tpot_ms_p50") or 0 for r in records], color=colors)
    axes[1].set_ylabel("TPOT p50 (ms)")
    axes[1].tick_params(axis="x", labelrotation=60, labelsize=7)
    fig.suptitle("offline sweep: corun settings (blue) and the peers' token budget (red)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default=None)
    parser.add_argument("--num-requests", type=int, default=300)
    parser.add_argument("--input-len", type=int, nargs=2, default=(256, 2048))
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--points", nargs="*", default=None, help="labels to run (default all)")
    parser.add_argument("--time-budget-s", type=float, default=420.0)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.88)
    parser.add_argument("--dry-run", action="store_true", help="CPU smoke: tiny steps")
    parser.add_argument("--warmup-burst", type=int, default=32)
    parser.add_argument("--reruns-if-compiled", type=non_negative_int, default=1, metavar="N",
                        help="run a point's timed run again (up to N times) if Triton compiled")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default="sweep-offline-h200")
    parser.add_argument("--print-best", metavar="RESULTS_JSON", nargs="+", default=None,
                        help="print the best corun point's settings of these sweep files as "
                             "bench_offline --corun-set arguments, and exit")
    args = parser.parse_args(argv)
    if args.print_best:
        runs = [[r for r in json.loads(Path(path).read_text()) if not r.get("header")]
                for path in args.print_best]
        print(" ".join(best_corun_settings(runs)))
        return
    t0 = time.perf_counter()
    from models import build_model

    base = EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                        max_num_seqs=args.max_num_seqs,
                        max_model_len=args.input_len[1] + args.output_len,
                        gpu_memory_utilization=args.gpu_memory_utilization)
    model = build_model(args.model, dtype=base.torch_dtype, device=base.resolved_device,
                        seed=args.seed)
    work = make_workload(args.num_requests, tuple(args.input_len), args.output_len,
                         model[1].vocab_size, args.seed)
    points = [(label, fields) for label, fields in grid(args.max_num_seqs, args.dry_run)
              if args.points is None or label in args.points]
    configs = [(label, dataclasses.replace(base, **fields)) for label, fields in points]
    # default's points first: every file needs one for --print-best's ratios, and a run cut by
    # its time budget keeps what ran first; then by runner, so consecutive points share one.
    configs.sort(key=lambda p: (str(p[1].mode) != "default",
                                tuple(str(getattr(p[1], f)) for f in RUNNER_FIELDS)))
    extra = {"model": args.model, "workload": {"num_requests": args.num_requests,
             "input_len": list(args.input_len), "output_len": args.output_len,
             "max_num_seqs": args.max_num_seqs, "arrivals": "all at t=0"},
             "timing": "wall clock of each point's run after warm-up; per-step profile with a "
                       "device sync around each step"}
    records: list[dict] = []
    runner, runner_key, args.input_len = None, None, tuple(args.input_len)
    for label, config in configs:
        if time.perf_counter() - t0 > args.time_budget_s:
            print(f"time budget spent: skipping {label} and later points", flush=True)
            continue
        key = tuple(getattr(config, f) for f in RUNNER_FIELDS)
        if key != runner_key:
            release_runner(runner)
            runner, runner_key = ModelRunner(config, model=model), key
        engine, finals, record = measure_point(config, runner, work, args, label)
        record = {"point": label, **record, "config": {
            f: getattr(config, f) for f in (*RUNNER_FIELDS, "prefill_token_budget")}}
        record["config"]["mode"] = config.kernel_mode.value
        records.append(record)
        print(json.dumps(record), flush=True)
        path = write_results(args.name, records, **extra)
    release_runner(runner)
    if records:
        plot(records, path.with_suffix(".png"))
        print(f"wrote {path} in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
