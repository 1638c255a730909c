"""Serving benchmark: drive a running ``corun.serve`` over HTTP, as ``vllm bench serve`` does.

Requests arrive as a Poisson process at each ``--request-rate`` (``inf`` = all at t=0; gaps are
Gamma(burstiness, 1/(rate*burstiness)), burstiness 1 = Poisson), optionally capped by a client-side
``--max-concurrency`` semaphore. Prompts are random token ids (``--random-input-len`` and
``--random-output-len`` with ``--random-range-ratio``: lengths uniform in [L(1-r), L(1+r)]), sent
to ``/v1/completions`` with ``stream: true``, ``ignore_eos`` and a per-request seed, so every run of
the same arguments sends the same requests.

Per request: TTFT (first chunk with choices), ITL (every later chunk gap), E2EL (last token chunk)
and TPOT = (E2EL - TTFT) / (output_len - 1). Reported with vLLM's key names (``mean_ttft_ms``,
``p99_itl_ms``, ``request_throughput``, ...) and its printed " Serving Benchmark Result " block.
Per run, from a corun server's ``/metrics`` read before and after it: the engine's steps by kind
(``engine_steps``), their mean wall time (``engine_step_ms_mean``) and scheduled tokens a step
(``step_tokens_mean``), which tell prefill time from decode time (``step_breakdown``).

Two ways to run it:

- against a server you started: ``python experiments/bench_serving.py --base-url URL
  --request-rate 1,4,16,inf``;
- as the driver that starts ``python -m corun.serve`` itself once per mode and writes
  ``experiments/results/<--result-name>.json`` (header from ``experiments.harness``) plus one
  latency-vs-rate PNG per mode: ``python experiments/bench_serving.py --launch --modes
  corun,batch_invariant_tuned,batch_invariant,default --model qwen3-8b --request-rate 2,8,32
  --max-concurrency 64 --time-budget-s 480``. ``--time-budget-s`` splits the budget over the modes
  and the runs and cuts
  each run's request count to fit it. ``--variant LABEL=MODE FLAGS`` adds a server of MODE with
  more flags under its own label (e.g. ``--variant "corun-t2048=corun --prefill-step-tokens
  2048 --prefill-token-budget 2048"``), timed in the same run as the plain modes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from corun.api.metrics import STEP_KINDS  # noqa: E402  (the step kinds the server counts)
from experiments.harness import RESULTS_DIR, WARMUP_LENGTHS, write_results  # noqa: E402
from experiments.serving_client import make_requests, run_benchmark, summarize  # noqa: E402
from experiments.serving_log import print_result  # noqa: E402
from experiments.serving_servers import (  # noqa: E402
    ServerSpec,
    free_port,
    launch_server,
    parse_variant,
    server_specs,
    stop_server,
)

# A server's start-up seconds are read from this clock (a test replaces it).
_clock = time.perf_counter


# The server's engine-step series: two by kind, one over all steps (corun.api.metrics).
STEP_KIND_SERIES = ("corun:engine_steps_total", "corun:engine_step_seconds_sum")
STEP_TOKENS_SERIES = "corun:engine_step_tokens_sum"


def step_counters(base_url: str) -> dict[str, float] | None:
    """The server's engine-step series (``corun:engine_steps_total`` and
    ``corun:engine_step_seconds_sum`` by kind, ``corun:engine_step_tokens_sum``), or None
    for a server that does not export them (another engine)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        response = httpx.get(f"{base_url}/metrics", timeout=10.0)
    except httpx.HTTPError:  # the step figures are a side record: the run goes on without
        return None
    if response.status_code != 200:
        return None
    out: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(response.text):
            for sample in family.samples:
                kind = sample.labels.get("kind")
                if sample.name in STEP_KIND_SERIES:
                    out[f"{sample.name}[{kind}]"] = sample.value
                elif sample.name == STEP_TOKENS_SERIES:
                    out[sample.name] = sample.value
    except ValueError:  # not Prometheus text
        return None
    wanted = {f"{name}[{kind}]" for name in STEP_KIND_SERIES for kind in STEP_KINDS}
    wanted.add(STEP_TOKENS_SERIES)
    return out if wanted <= out.keys() else None  # all of a corun server's series, or none


def step_breakdown(before: dict[str, float] | None, after: dict[str, float] | None) -> dict:
    """One run's engine steps from the counters around it: steps and wall seconds by kind,
    mean step time, and scheduled tokens a step (empty where the server exports none)."""
    if not before or not after:
        return {}
    steps = {k: int(after[f"corun:engine_steps_total[{k}]"]
                    - before[f"corun:engine_steps_total[{k}]"]) for k in STEP_KINDS}
    seconds = {k: after[f"corun:engine_step_seconds_sum[{k}]"]
               - before[f"corun:engine_step_seconds_sum[{k}]"] for k in STEP_KINDS}
    total = sum(steps.values())
    tokens = after["corun:engine_step_tokens_sum"] - before["corun:engine_step_tokens_sum"]
    return {"engine_steps": steps,
            "engine_step_seconds": {k: round(v, 4) for k, v in seconds.items()},
            "engine_step_ms_mean": {k: round(seconds[k] / steps[k] * 1e3, 3)
                                    for k in STEP_KINDS if steps[k]},
            "step_tokens_mean": round(tokens / total, 2) if total else None}


def served_model(base_url: str) -> str:
    return httpx.get(base_url.rstrip("/") + "/v1/models", timeout=30).json()["data"][0]["id"]


def warm_up(args: argparse.Namespace, base_url: str, model: str) -> float:
    """Untimed requests first, so no timed run pays for JIT compilation or a first-shape
    allocation: single prompts at every warm-up length (``harness.WARMUP_LENGTHS``) up to the
    longest the runs send, then a burst of ``--warmup-requests`` at the workload's lengths, all at
    once. Returns seconds.
    """
    start = time.perf_counter()
    longest = int(args.random_input_len * (1 + args.random_range_ratio))
    singles = [([i % args.vocab_range] * n, 2, i) for i, n in enumerate(WARMUP_LENGTHS)
               if n <= longest]
    for request in singles:
        asyncio.run(run_benchmark(base_url, model, [request], math.inf, None, 1.0,
                                  args.temperature, args.seed))
    burst = make_requests(args.warmup_requests, args.random_input_len, 4,
                          args.random_range_ratio, args.vocab_range, args.seed + 999)
    asyncio.run(run_benchmark(base_url, model, burst, math.inf, None, 1.0, args.temperature,
                              args.seed))
    return time.perf_counter() - start


def sweep(args: argparse.Namespace, base_url: str, mode: str, budget_s: float | None,
          on_record: Callable[[list[dict]], object] | None = None) -> list[dict]:
    """Every rate of ``--request-rate`` (plus the max-concurrency run) against one server,
    after a warm-up; ``on_record`` gets the records so far after each run."""
    model = args.served_model or served_model(base_url)
    warmup_s = warm_up(args, base_url, model) if args.warmup_requests else 0.0
    runs = [
        (rate, args.max_concurrency if rate == math.inf else None) for rate in args.request_rate
    ]
    if args.max_concurrency and math.inf not in args.request_rate:
        runs.append((math.inf, args.max_concurrency))
    per_run_s = budget_s / len(runs) if budget_s else None
    records = []
    for index, (rate, concurrency) in enumerate(runs):
        num = args.num_prompts
        if per_run_s is not None and not math.isinf(rate):
            num = max(1, min(num, int(rate * per_run_s * 0.7)))  # arrivals end at 70% of the slice
        requests = make_requests(
            num,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            args.vocab_range,
            args.seed + index,
        )
        counters_before = step_counters(base_url)
        results, duration = asyncio.run(
            run_benchmark(
                base_url,
                model,
                requests,
                rate,
                concurrency,
                args.burstiness,
                args.temperature,
                args.seed + index,
                deadline_s=per_run_s,
            )
        )
        record = {
            "mode": mode,
            "model": model,
            "request_rate": rate if not math.isinf(rate) else "inf",
            "max_concurrency": concurrency,
            "burstiness": args.burstiness,
            "num_prompts": num,
            "random_input_len": args.random_input_len,
            "random_output_len": args.random_output_len,
            "warmup_s": round(warmup_s, 1),
            **summarize(results, duration),
            # the run's steps: requests of the run before are finished, the next not yet sent
            **step_breakdown(counters_before, step_counters(base_url)),
        }
        print(f"\nmode={mode} rate={record['request_rate']} max_concurrency={concurrency}")
        print_result(record)
        records.append(record)
        if on_record is not None:
            on_record(records)
    return records


def plot(records: list[dict], label: str, out_dir: Path, name: str) -> Path:
    """Median and p99 TTFT, TPOT and E2EL against the request rate, for one server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(
        (r for r in records if r.get("label", r["mode"]) == label and "error" not in r
         and r["request_rate"] != "inf"),
        key=lambda r: r["request_rate"],
    )
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, metric in zip(axes, ("ttft", "tpot", "e2el"), strict=False):
        rates = [r["request_rate"] for r in rows]
        for stat, style in (("median", "o-"), ("p99", "s--")):
            ax.plot(rates, [r[f"{stat}_{metric}_ms"] for r in rows], style, label=stat)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"{metric.upper()} (ms)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{name}: latency vs request rate, {label}")
    fig.tight_layout()
    path = out_dir / f"{name}-{label}.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def parse_rates(text: str) -> list[float]:
    return [math.inf if item.strip() == "inf" else float(item) for item in text.split(",")]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="a running server")
    p.add_argument(
        "--launch",
        action="store_true",
        help="start python -m corun.serve per --modes instead of using --base-url",
    )
    p.add_argument("--modes", default="corun,batch_invariant_tuned,batch_invariant,default",
                   help="with --launch")
    p.add_argument("--variant", type=parse_variant, action="append", default=[],
                   metavar="LABEL=MODE FLAGS", help="with --launch: one more server, of MODE "
                   "with FLAGS after --server-args, whose records carry LABEL (repeatable)")
    p.add_argument("--warmup-requests", type=int, default=64,
                   help="untimed requests sent to each server before its timed runs (0: none)")
    p.add_argument("--model", default=None, help="with --launch: --model of the server")
    p.add_argument("--server-args", default="", help="with --launch: more corun.serve flags")
    p.add_argument(
        "--served-model", default=None, help="model field (default: first of /v1/models)"
    )
    p.add_argument(
        "--request-rate",
        type=parse_rates,
        default=[math.inf],
        help="comma-separated req/s, 'inf' = all at once",
    )
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="client-side cap on requests in flight; also adds an inf-rate run",
    )
    p.add_argument("--burstiness", type=float, default=1.0, help="1 = Poisson arrivals")
    p.add_argument(
        "--num-prompts", type=int, default=200, help="requests per run (before the budget)"
    )
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument(
        "--random-range-ratio", type=float, default=0.5, help="lengths uniform in [L(1-r), L(1+r)]"
    )
    p.add_argument(
        "--vocab-range",
        type=int,
        default=256,
        help="prompt ids are drawn from [0, this): 256 is valid for every CoRun model",
    )
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--time-budget-s",
        type=float,
        default=None,
        help="wall budget of the measurements (server start-ups not included), split over "
        "modes and runs; each run's request count is cut to fit its share",
    )
    p.add_argument("--result-name", default="serving-h200")
    p.add_argument("--result-dir", default=str(RESULTS_DIR))
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if not 0.0 <= args.random_range_ratio < 1.0:
        raise SystemExit("--random-range-ratio must be in [0, 1)")
    out_dir = Path(args.result_dir)
    if not args.launch:
        records = sweep(args, args.base_url, mode="external", budget_s=args.time_budget_s)
        print(json.dumps(records, indent=1))
        return
    specs = server_specs(args)
    budget = args.time_budget_s / len(specs) if args.time_budget_s else None
    records: list[dict] = []

    started: dict[str, float] = {}  # seconds from launch to healthy (graph capture included)

    def labelled(spec: ServerSpec, runs: list[dict]) -> list[dict]:
        return [{"label": spec.label, **r, "extra_server_args": spec.extra_args,
                 "server_start_s": started.get(spec.label)} for r in runs]

    def save(spec: ServerSpec, runs: list[dict]) -> Path:
        # Written after every rate, so a run cut by its time limit keeps what it measured.
        return write_results(
            args.result_name,
            records + labelled(spec, runs),
            out_dir,
            bench="serving",
            args={k: str(v) for k, v in vars(args).items()},
        )

    for spec in specs:
        port = free_port()
        launched = _clock()
        try:
            proc = launch_server(spec, port, args)
        except (RuntimeError, TimeoutError) as exc:
            # A server that does not come up (its start-up failed) is recorded as such, and the
            # servers after it still run.
            print(f"server {spec.label} did not start: {exc}", flush=True)
            records.append({"label": spec.label, "mode": spec.mode,
                            "extra_server_args": spec.extra_args, "error": repr(exc)[:300]})
            path = save(spec, [])
            continue
        started[spec.label] = round(_clock() - launched, 1)
        try:
            runs = sweep(args, f"http://127.0.0.1:{port}", spec.mode, budget,
                         on_record=lambda runs, spec=spec: save(spec, runs))
        finally:
            stop_server(proc)
        path = save(spec, runs)
        records += labelled(spec, runs)
        plot(records, spec.label, out_dir, args.result_name)
    print(f"wrote {path}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
