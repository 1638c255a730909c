"""Offline throughput, latency and a determinism audit of the three modes, side by side.

One model (Qwen3-8B shape, seeded random weights, bf16 by default) and one workload (input lengths
uniform in [256, 2048], 256 output tokens with EOS ignored, every request submitted at once, each
with its own sampling seed) run under ``default``, ``batch_invariant`` and ``corun`` with the same
engine. Per mode:

- **main run**: all requests, ``--max-num-seqs`` concurrency: output tokens/s, TTFT and TPOT
  (mean/p50/p99) from each request's arrival, first-token and finish times;
- **audit**: the same workload again under another schedule (arrival order shuffled, concurrency
  ``--audit-max-num-seqs``; corun keeps its decode batch ``B``), plus a sample of requests each run
  alone; ``mismatches`` counts requests whose fingerprint differs from their main-run fingerprint.

``corun_overlap`` (or ``--overlap``, which adds it) is corun with ``overlap_prefill_decode``: each
decode step carries one isolated prefill chunk on a second CUDA stream (issue 5 ablation); its
record's mode is ``corun+overlap``. ``--max-prefill-steps-between-decodes`` sets corun's stall
bound.

Also recorded for corun and corun+overlap: the memory bound of one decode step at ``B`` (weights
plus the KV of B sequences at the mean context, read once at the measured H200 bandwidth) and
TPOT p50 over it.

``--time-budget-s``: a calibration (one isolated prefill, a few decode steps) estimates each run's
time, and the request count (and the alone sample) shrink so that all modes fit. Writes
``experiments/results/offline-h200.json`` (header + one record per mode) and a PNG beside it.

    python -m experiments.bench_offline                       # H200: Qwen3-8B shape, all modes
    python -m experiments.bench_offline --model tiny-qwen3 --device cpu --dtype float32 \\
        --num-requests 8 --input-len 8 32 --output-len 8 --max-num-seqs 4 --name offline-cpu-smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import random
import statistics
import time

import torch

from corun.config import EngineConfig
from corun.engine import LLMEngine
from corun.model_runner import ModelRunner
from corun.outputs import RequestOutput
from corun.sampling_params import SamplingParams
from experiments.harness import memory_bound_us, write_results

# corun first: if the device time runs out, the headline record is already written.
MODES = ("corun", "batch_invariant", "default")
CHOICES = (*MODES, "corun_overlap")  # corun_overlap: the issue-5 ablation, only when asked for
# Calibration gives corun-mode costs; batch-invariant kernels are slower (no split-K, fixed tiles),
# and the schedules differ, so the estimate carries a margin per mode.
MODE_COST_FACTOR = {"default": 1.0, "batch_invariant": 2.5, "corun": 1.2, "corun_overlap": 1.2}
# The record's "mode" and the engine's (mode, overlap_prefill_decode) of each --modes choice.
RECORD_NAME = {"corun_overlap": "corun+overlap"}
ENGINE_MODE = {"corun_overlap": ("corun", True)}


@dataclasses.dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    params: list[SamplingParams]


def make_workload(num: int, input_len: tuple[int, int], output_len: int, vocab: int,
                  seed: int) -> Workload:
    rng = random.Random(seed)
    prompts, params = [], []
    for _ in range(num):
        length = rng.randint(*input_len)
        prompts.append([rng.randrange(vocab) for _ in range(length)])
        params.append(SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=1.0,
                                     seed=rng.getrandbits(64)))
    return Workload(prompts, params)


def run_workload(engine: LLMEngine, work: Workload, order: list[int]) -> tuple[dict, float]:
    """Submit ``order``'s requests at once, run to completion; (index -> output, seconds)."""
    if engine.device_is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    ids = {engine.add_request(work.prompts[i], work.params[i], f"r{i}", arrival_time=start): i
           for i in order}
    finals: dict[int, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[ids[out.request_id]] = out
    return finals, time.perf_counter() - start


def latency_stats(outputs: list[RequestOutput]) -> dict:
    ttft = sorted(o.metrics.ttft_s * 1e3 for o in outputs)
    tpot = sorted(o.metrics.tpot_s * 1e3 for o in outputs if o.metrics.tpot_s is not None)

    def pct(values: list[float], q: float) -> float | None:
        if not values:
            return None
        return round(values[min(len(values) - 1, int(q * len(values)))], 3)

    return {
        "ttft_ms_mean": round(statistics.fmean(ttft), 3), "ttft_ms_p50": pct(ttft, 0.5),
        "ttft_ms_p99": pct(ttft, 0.99),
        "tpot_ms_mean": round(statistics.fmean(tpot), 3) if tpot else None,
        "tpot_ms_p50": pct(tpot, 0.5), "tpot_ms_p99": pct(tpot, 0.99),
    }


def decode_bound_ms(runner: ModelRunner, batch: int, mean_context: float) -> float:
    """Weights + the KV of ``batch`` sequences at ``mean_context`` tokens, read once."""
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    spec = runner.kv_cache.spec
    kv_per_token = spec.bytes_per_block(1, runner.dtype)
    return memory_bound_us(weight_bytes + batch * mean_context * kv_per_token) / 1e3


def calibrate(runner: ModelRunner, config: EngineConfig, input_len: int, steps: int = 8) -> dict:
    """Seconds of one isolated prefill of ``input_len`` tokens and of one corun decode step."""
    engine = LLMEngine(config, model_runner=runner)
    params = SamplingParams(max_tokens=steps + 1, ignore_eos=True, temperature=0.0)
    prompt = [1] * input_len
    for _ in range(2):  # the first round compiles kernels
        sync = torch.cuda.synchronize if engine.device_is_cuda else (lambda: None)
        engine.add_request(prompt, params)
        sync()
        start, prefill_s, steps_s = time.perf_counter(), None, []
        while engine.has_unfinished_requests():
            outs = engine.step()
            sync()
            now = time.perf_counter()
            if outs and prefill_s is None:
                prefill_s = now - start
            elif outs:
                steps_s.append(now - start)
            start = now
    return {"prefill_s": prefill_s, "decode_step_s": statistics.median(steps_s)}


def plan(args: argparse.Namespace, cal: dict) -> tuple[int, int]:
    """(num_requests, alone sample) that fit the time budget according to the calibration."""
    mean_in = sum(args.input_len) / 2
    per_request = cal["prefill_s"] * mean_in / args.input_len[1]  # prefill time of one request
    decode = cal["decode_step_s"]
    spent = time.perf_counter() - args.t0
    budget = args.time_budget_s - spent - 30.0 * len(args.modes)  # engine builds, graph capture

    factor = sum(MODE_COST_FACTOR[m] for m in args.modes)
    # A request alone still decodes its output_len steps one by one: the alone sample is the
    # costly part of the audit, so it gets at most 30% of the budget.
    solo_each = factor * (per_request + args.output_len * decode)
    alone = max(2, min(args.alone_sample, int(0.3 * budget / solo_each)))

    def cost(n: int) -> float:
        run = n * per_request + (n * args.output_len / args.max_num_seqs) * decode
        return factor * 2 * run + min(alone, n) * solo_each

    n = args.num_requests
    while n > 1 and cost(n) > budget:
        n = max(1, int(n * 0.95))
    return n, min(alone, n)


def bench_mode(choice: str, model, args: argparse.Namespace, work: Workload,
               alone_sample: int) -> dict:
    mode, overlap = ENGINE_MODE.get(choice, (choice, False))
    base = EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, mode=mode,
        overlap_prefill_decode=overlap,
        max_num_seqs=args.max_num_seqs, decode_batch_size=args.max_num_seqs,
        max_model_len=args.input_len[1] + args.output_len,
        prefill_chunk_size=args.prefill_chunk_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_prefill_steps_between_decodes=args.max_prefill_steps_between_decodes,
        gpu_memory_utilization=args.gpu_memory_utilization, cuda_graphs=not args.eager,
        num_kv_blocks=args.num_kv_blocks, seed=args.seed,
    )
    runner = ModelRunner(base, model=model)
    main_engine = LLMEngine(base, model_runner=runner)
    # Warm-up on a throwaway request so JIT compilation is not charged to the first run.
    run_workload(main_engine, Workload([work.prompts[0]], [dataclasses.replace(
        work.params[0], max_tokens=2)]), [0])
    order = list(range(len(work.prompts)))
    first, seconds = run_workload(main_engine, work, order)
    outputs = [first[i] for i in order]
    record = {
        "mode": RECORD_NAME.get(choice, choice), "requests": len(order),
        "output_tok_s": round(sum(len(o.token_ids) for o in outputs) / seconds, 2),
        "wall_s": round(seconds, 3), **latency_stats(outputs),
        "num_preemptions": main_engine.stats()["num_preemptions"],
        "num_kv_blocks": runner.num_kv_blocks,
    }
    # Audit 1: another schedule, shuffled arrivals and another concurrency limit.
    shuffled = order[:]
    random.Random(args.seed + 1).shuffle(shuffled)
    audit_config = dataclasses.replace(base, max_num_seqs=args.audit_max_num_seqs)
    second, _ = run_workload(LLMEngine(audit_config, model_runner=runner), work, shuffled)
    schedule_mismatch = [i for i in order if second[i].fingerprint != first[i].fingerprint]
    # Audit 2: a sample of requests, each alone.
    sample = random.Random(args.seed + 2).sample(order, alone_sample)
    alone_mismatch = []
    for i in sample:
        solo, _ = run_workload(main_engine, work, [i])
        if solo[i].fingerprint != first[i].fingerprint:
            alone_mismatch.append(i)
    record.update({
        "mismatches": len(set(schedule_mismatch) | set(alone_mismatch)),
        "mismatches_reschedule": len(schedule_mismatch), "mismatches_alone": len(alone_mismatch),
        "alone_sample": len(sample), "audit_max_num_seqs": args.audit_max_num_seqs,
    })
    if mode == "corun":
        mean_ctx = sum(args.input_len) / 2 + args.output_len / 2
        bound = decode_bound_ms(runner, args.max_num_seqs, mean_ctx)
        record["decode_bound_ms_at_B"] = round(bound, 6)
        if record["tpot_ms_p50"] is not None:
            record["tpot_p50_over_bound"] = round(record["tpot_ms_p50"] / bound, 3)
    runner.destroy()
    return record


def plot(records: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [r["mode"] for r in records]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    colors = {"default": "#999999", "batch_invariant": "#cc6666", "corun": "#3366cc",
              "corun+overlap": "#33aa77"}
    for ax, key, label in zip(axes, ("output_tok_s", "ttft_ms_p50", "tpot_ms_p50"),
                              ("output tokens/s", "TTFT p50 (ms)", "TPOT p50 (ms)"), strict=True):
        ax.bar(modes, [r.get(key) or 0 for r in records], color=[colors[m] for m in modes])
        ax.set_title(label)
        for i, r in enumerate(records):
            ax.text(i, r.get(key) or 0, f"mism. {r['mismatches']}" if key == "output_tok_s" else "",
                    ha="center", va="bottom", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default=None)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=CHOICES)
    parser.add_argument("--overlap", action="store_true",
                        help="also run corun_overlap: corun with overlap_prefill_decode")
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--input-len", type=int, nargs=2, default=(256, 2048))
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=128, help="and corun's B")
    parser.add_argument("--audit-max-num-seqs", type=int, default=None, help="default: half")
    parser.add_argument("--alone-sample", type=int, default=32)
    parser.add_argument("--prefill-chunk-size", type=int, default=512)
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--max-prefill-steps-between-decodes", type=int, default=1,
                        help="corun's decode-stall bound (under overlap it counts the "
                             "prefill chunk each decode step carries)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.88)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--time-budget-s", type=float, default=450.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default="offline-h200")
    args = parser.parse_args(argv)
    args.t0 = time.perf_counter()
    if args.overlap and "corun_overlap" not in args.modes:
        args.modes.append("corun_overlap")
    args.audit_max_num_seqs = args.audit_max_num_seqs or max(1, args.max_num_seqs // 2)
    from models import build_model

    probe = EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                         max_model_len=args.input_len[1] + args.output_len,
                         max_num_seqs=args.max_num_seqs,
                         max_num_batched_tokens=args.max_num_batched_tokens)
    model = build_model(args.model, dtype=probe.torch_dtype, device=probe.resolved_device,
                        seed=args.seed)
    cal_config = dataclasses.replace(probe, mode="corun", decode_batch_size=args.max_num_seqs,
                                     prefill_chunk_size=args.prefill_chunk_size,
                                     cuda_graphs=not args.eager, num_kv_blocks=args.num_kv_blocks,
                                     gpu_memory_utilization=args.gpu_memory_utilization)
    cal_runner = ModelRunner(cal_config, model=model)
    cal = calibrate(cal_runner, cal_config, args.input_len[1])
    cal_runner.destroy()
    del cal_runner
    gc.collect()
    if probe.is_cuda:
        torch.cuda.empty_cache()
    num_requests, alone = plan(args, cal)
    work = make_workload(num_requests, tuple(args.input_len), args.output_len,
                         model[1].vocab_size, args.seed)
    print(f"calibration {json.dumps(cal)}; running {num_requests} requests, alone sample {alone}")
    records = []
    extra = {"model": args.model, "dtype": args.dtype, "calibration": cal,
             "workload": {"num_requests": num_requests, "requested": args.num_requests,
                          "input_len": list(args.input_len), "output_len": args.output_len,
                          "max_num_seqs": args.max_num_seqs, "B": args.max_num_seqs,
                          "max_prefill_steps_between_decodes":
                              args.max_prefill_steps_between_decodes,
                          "audit_max_num_seqs": args.audit_max_num_seqs}}
    for mode in args.modes:
        records.append(bench_mode(mode, model, args, work, alone))
        print(json.dumps(records[-1]))
        gc.collect()
        if probe.is_cuda:
            torch.cuda.empty_cache()
        path = write_results(args.name, records, **extra)  # after every mode: keep partial results
    by_mode = {r["mode"]: r for r in records}
    for name, peers in (("corun", ("batch_invariant", "default")),
                        ("corun+overlap", ("batch_invariant", "default", "corun"))):
        if name not in by_mode:
            continue
        for peer in peers:
            if peer in by_mode and by_mode[peer]["output_tok_s"]:
                by_mode[name][f"throughput_vs_{peer}"] = round(
                    by_mode[name]["output_tok_s"] / by_mode[peer]["output_tok_s"], 3)
    path = write_results(args.name, records, **extra)
    plot(records, path.with_suffix(".png"))
    print(f"wrote {path} in {time.perf_counter() - args.t0:.0f} s")


if __name__ == "__main__":
    main()
