"""Offline throughput, latency and a determinism audit of the engine's modes, side by side.

One model (Qwen3-8B shape, seeded random weights, bf16 by default) and one workload (input lengths
uniform in [256, 2048], 256 output tokens with EOS ignored, every request submitted at once, each
with its own sampling seed) run under every variant asked for, on the same weights:

- ``corun`` (packed prefill, the shipped defaults or ``--corun-set key=value`` overrides),
  ``corun_isolated`` (the paper's one-request prefill steps), ``corun_overlap``;
- the two batch-invariant peers ``batch_invariant`` (portable: one tile config for every shape)
  and ``batch_invariant_tuned`` (the strongest this hardware allows: tiles per shape, reduction
  order pinned), and ``default`` (fastest per shape, not deterministic).

Per variant:

- **warm-up** before anything is timed: every fixed shape (graph capture or one eager run) and a
  warm-up workload (single prompts at every GEMM bucket length and one token short of it,
  ``harness.WARMUP_LENGTHS``, then a burst of ``--warmup-burst`` short requests) so that the
  dynamic modes compile their per-M configs too. Their mixed steps can still reach shapes the
  warm-up did not (Triton specialises a kernel on each int argument's divisibility by 16 as well
  as on its config), so a main run in which Triton compiled is run again on a fresh engine, up
  to ``--reruns-if-compiled`` times, and the last one is recorded (``timed_run``; the discarded
  runs' compiles and seconds are in ``discarded_runs``): on the H200 the peers' first runs
  compiled 2-10 kernels and paid seconds for it;
- **main run**: all requests: output tokens/s, TTFT and TPOT (mean/p50/p99) from each request's
  arrival, first-token and finish times, and a per-step profile (``LLMEngine(profile_steps)``:
  the device is synchronised around each step): steps per kind, their median ms, mean live rows;
- **decode bound of the steps timed**: for every profiled decode step, the weights it reads (not
  the embedding, only gathered; of a MoE layer the experts its live tokens route to, expected
  under uniform routing, as ``bench_models``) plus the KV of *its* live sequences at *their*
  lengths, read once at the measured H200 bandwidth; the record
  gives the median step / bound ratio and TPOT p50 over the bound at the mean live count;
- **audit**: ``--audit-requests`` of the requests again, arrival order shuffled, concurrency
  ``--audit-max-num-seqs`` (it binds: half of max_num_seqs), and ``--alone-sample`` (>= 16)
  requests each run alone; ``mismatches`` counts fingerprints that differ from the main run.

Prefix caching: ``--prefix-caching on`` (the engine's default), ``off``, or ``both`` (each variant
twice, the cache-off run recorded as ``<variant>_nocache``; the cache-on record then gets its
throughput and TTFT against it and ``mismatches_vs_nocache``: requests whose fingerprints differ
between the two main runs, 0 expected under corun and batch_invariant). Each record carries the
prefix-cache queries, hits and hit rate of its main run. The warm-up runs on an engine of its own,
so the main run starts with an empty cache. ``--workload shared-prefix``: ``--num-system-prompts``
system prompts (lengths in ``--system-len``) each followed by short questions (``--question-len``)
and, with ``--n-request N``, one more request that samples one of them N times.

Writes ``experiments/results/<--name>.json`` (header + one record per variant, rewritten after
each variant, so a cut run keeps what it measured) and a PNG beside it.

    python -m experiments.bench_offline                       # H200: Qwen3-8B shape, all variants
    python -m experiments.bench_offline --model tiny-qwen3 --device cpu --dtype float32 \\
        --num-requests 8 --input-len 8 32 --output-len 8 --max-num-seqs 4 --name offline-cpu-smoke
    python -m experiments.bench_offline --workload shared-prefix --prefix-caching both \\
        --modes corun batch_invariant default --name offline-prefix-h200     # H200, caching
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import random
import time

import torch
from tqdm.auto import tqdm

from corun.config import EngineConfig
from corun.engine import LLMEngine
from corun.model_runner import ModelRunner
from corun.sampling_params import SamplingParams
from experiments.harness import WARMUP_LENGTHS, bandwidth_label, count_jit_compiles, write_results
from experiments.offline_stats import latency_stats, step_profile
from experiments.offline_workload import (
    Workload,
    fingerprints,
    make_shared_prefix_workload,
    make_workload,
    num_output_tokens,
    run_workload,
)

# Variant -> (engine mode, EngineConfig overrides). corun first: if the device time runs out,
# the headline record is already written.
VARIANTS: dict[str, tuple[str, dict]] = {
    "corun": ("corun", {}),
    "corun_isolated": ("corun", {"prefill_policy": "isolated"}),
    "corun_overlap": ("corun", {"overlap_prefill_decode": True}),
    "batch_invariant": ("batch_invariant", {}),
    "batch_invariant_tuned": ("batch_invariant_tuned", {}),
    "default": ("default", {}),
    # Without path invariance (EngineConfig.path_invariant): what a token's decode == prefill
    # bits cost, measured beside the variants above.
    "corun_path_variant": ("corun", {"path_invariant": False}),
    "batch_invariant_tuned_path_variant": ("batch_invariant_tuned", {"path_invariant": False}),
}
HEADLINE = ("corun", "batch_invariant_tuned", "batch_invariant", "default")
# The EngineConfig fields each record lists (its ``config``), here and in the ablations.
CONFIG_FIELDS = ("max_num_seqs", "decode_batch_size", "prefill_policy", "prefill_chunk_size",
                 "prefill_step_tokens", "max_prefill_seqs_per_step", "prefill_token_budget",
                 "overlap_prefill_decode", "max_num_batched_tokens", "decode_split_size",
                 "decode_fused_combine", "cuda_graphs", "dynamic_graph_tokens", "path_invariant")


def config_record(config: EngineConfig, runner: ModelRunner) -> dict:
    """A record's ``config``: ``CONFIG_FIELDS`` as set, and the dynamic buckets the runner
    actually padded to (none for a model without prefill graphs unless asked)."""
    return {**{k: getattr(config, k) for k in CONFIG_FIELDS},
            "dynamic_step_tokens": runner.dynamic_step_tokens}


def warm_up(engine: LLMEngine, work: Workload, args: argparse.Namespace) -> float:
    """Compile everything the timed runs will launch; returns the seconds it took."""
    start = time.perf_counter()
    engine.runner.warmup()
    vocab = engine.vocab_size
    short = SamplingParams(max_tokens=3, ignore_eos=True, temperature=1.0, seed=1)
    top = min(args.input_len[1], engine.config.max_model_len - 4)
    lengths = sorted({min(n, top) for n in WARMUP_LENGTHS})
    singles = Workload([[i % vocab + 1] * n for i, n in enumerate(lengths)], [short] * len(lengths))
    for i in range(len(lengths)):
        run_workload(engine, singles, [i])
    # The burst's prompts are the workload's first ones: with prefix caching on this engine now
    # caches them, which is why the timed run gets an engine (and an empty cache) of its own.
    burst = min(args.warmup_burst, engine.config.max_num_seqs, len(work.prompts))
    run_workload(engine, Workload(work.prompts[:burst], [short] * burst), list(range(burst)))
    return time.perf_counter() - start


@dataclasses.dataclass
class TimedRun:
    """The recorded main run: its engine (step records, stats), each request's final output,
    wall seconds, the kernels Triton compiled in it, and the runs discarded before it."""

    engine: LLMEngine
    finals: dict
    seconds: float
    compiled: list[str]
    discarded: list[dict]

    def compile_fields(self) -> dict:
        """The record's account of JIT compilation: in the recorded run, and in those discarded."""
        return {"jit_compiles_timed": len(self.compiled),
                "jit_compiled_kernels": sorted(set(self.compiled))[:12],
                "discarded_runs": self.discarded}


def timed_run(config: EngineConfig, runner: ModelRunner, work: Workload, order: list[int],
              label: str, reruns_if_compiled: int) -> TimedRun:
    """The whole workload timed on a fresh engine, run again (up to ``reruns_if_compiled`` more
    times) while Triton compiles in it: a compile is a shape the warm-up missed, and its seconds
    are not the workload's. Every engine is new (scheduler, block manager, prefix cache); the
    runner's KV storage and graphs are shared, as the warm-up's and audit's engines share them.
    The discarded runs' compiles and wall seconds are kept for the record."""
    discarded: list[dict] = []
    while True:
        engine = LLMEngine(config, model_runner=runner, profile_steps=True)
        with count_jit_compiles() as compiled:
            finals, seconds = run_workload(engine, work, order, desc=label)
        if not compiled or len(discarded) == reruns_if_compiled:
            return TimedRun(engine, finals, seconds, compiled, discarded)
        discarded.append({"jit_compiles": len(compiled), "wall_s": round(seconds, 3)})


def engine_config(variant: str, args: argparse.Namespace, caching: bool = True) -> EngineConfig:
    mode, overrides = VARIANTS[variant]
    fields = dict(
        model=args.model, dtype=args.dtype, device=args.device, mode=mode,
        max_num_seqs=args.max_num_seqs, decode_batch_size=args.decode_batch_size,
        max_model_len=args.input_len[1] + args.output_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization, cuda_graphs=not args.eager,
        num_kv_blocks=args.num_kv_blocks, seed=args.seed)
    if args.workload == "shared-prefix":
        fields["max_model_len"] = (args.system_len[1] + args.question_len[1]
                                   + args.output_len)
    if mode == "corun":
        # B explicit, so the audit's smaller max_num_seqs keeps corun's decode shape.
        fields["decode_batch_size"] = args.decode_batch_size or args.max_num_seqs
        fields.update(args.corun_overrides)
    fields.update(overrides)
    fields["enable_prefix_caching"] = caching
    return EngineConfig(**fields)


def bench_variant(variant: str, model, args: argparse.Namespace, work: Workload,
                  caching: bool = True) -> tuple[dict, dict]:
    """One variant's record, and its main run's fingerprints per request index."""
    config = engine_config(variant, args, caching)
    build = time.perf_counter()
    runner = ModelRunner(config, model=model)
    build_s = time.perf_counter() - build
    warmup_s = warm_up(LLMEngine(config, model_runner=runner), work, args)
    order = list(range(len(work.prompts)))
    label = variant if caching or args.prefix_caching != "both" else f"{variant}_nocache"
    main = timed_run(config, runner, work, order, f"{label} main", args.reruns_if_compiled)
    main_engine, first, seconds = main.engine, main.finals, main.seconds
    outputs = [first[i] for i in order]
    stats = main_engine.stats()
    record = {
        "mode": label, "engine_mode": config.kernel_mode.value, "requests": len(order),
        "output_tok_s": round(sum(num_output_tokens(o) for o in outputs) / seconds, 2),
        "wall_s": round(seconds, 3), **latency_stats(outputs),
        "num_preemptions": stats["num_preemptions"],
        "prefix_caching": caching, "prefix_cache_granularity": config.prefix_cache_granularity,
        "prefix_cache_queries": stats["prefix_cache_queries"],
        "prefix_cache_hits": stats["prefix_cache_hits"],
        "prefix_cache_hit_rate": round(stats["prefix_cache_hit_rate"], 4),
        "num_kv_blocks": runner.num_kv_blocks, "build_s": round(build_s, 1),
        "num_graphs": runner.num_graphs, "warmup_s": round(warmup_s, 1),
        **main.compile_fields(),
        "config": config_record(config, runner),
        **step_profile(main_engine.step_records, runner),
    }
    if record.get("tpot_ms_p50") and record.get("decode_bound_ms_at_live_mean"):
        record["tpot_p50_over_bound"] = round(
            record["tpot_ms_p50"] / record["decode_bound_ms_at_live_mean"], 3)
    if not args.no_audit:
        record.update(audit(runner, config, work, first, args))
    if args.graph_check and config.use_cuda_graphs:
        record.update(graph_check(runner, config, model, work, args.graph_check))
    runner.destroy()
    return record, {i: fingerprints(first[i]) for i in order}


def graph_check(runner: ModelRunner, config: EngineConfig, model, work: Workload,
                num: int) -> dict:
    """The same short workload replayed from the graphs and run eagerly at the same step shapes
    (``ModelRunner.eager_twin``): fingerprints equal?"""
    short = Workload(work.prompts[:num], [dataclasses.replace(p, max_tokens=8)
                                          for p in work.params[:num]])
    order = list(range(len(short.prompts)))
    replayed, _ = run_workload(LLMEngine(config, model_runner=runner), short, order)
    eager_config = runner.eager_twin()  # the same step shapes, run eagerly
    runner.destroy()
    eager_runner = ModelRunner(eager_config, model=model)
    eager, _ = run_workload(LLMEngine(eager_config, model_runner=eager_runner), short, order)
    eager_runner.destroy()
    return {"graph_vs_eager_requests": num, "graph_vs_eager_mismatches": sum(
        fingerprints(replayed[i]) != fingerprints(eager[i]) for i in order)}


def audit(runner: ModelRunner, config: EngineConfig, work: Workload, first: dict,
          args: argparse.Namespace) -> dict:
    """Fingerprints under another schedule and alone, against the main run's."""
    rng = random.Random(args.seed + 1)
    order = list(range(len(work.prompts)))
    subset = rng.sample(order, min(args.audit_requests, len(order)))
    audit_config = dataclasses.replace(config, max_num_seqs=args.audit_max_num_seqs)
    second, _ = run_workload(LLMEngine(audit_config, model_runner=runner), work, subset,
                             desc="audit reschedule")
    rescheduled = [i for i in subset if fingerprints(second[i]) != fingerprints(first[i])]
    sample = random.Random(args.seed + 2).sample(order, min(args.alone_sample, len(order)))
    engine = LLMEngine(config, model_runner=runner)
    # One engine for every alone run: with caching on, later ones hit what earlier ones cached.
    alone = [i for i in tqdm(sample, desc="audit alone", leave=False)
             if fingerprints(run_workload(engine, work, [i])[0][i]) != fingerprints(first[i])]
    return {"mismatches": len(set(rescheduled) | set(alone)),
            "mismatches_reschedule": len(rescheduled), "audit_requests": len(subset),
            "audit_max_num_seqs": args.audit_max_num_seqs,
            "mismatches_alone": len(alone), "alone_sample": len(sample)}


def add_ratios(records: list[dict]) -> None:
    """Each corun variant's throughput against every peer measured in the same run (cache-on
    records against cache-on peers); each cache-on record against its own cache-off run."""
    by_mode = {r["mode"]: r for r in records}
    for name, r in by_mode.items():
        off = by_mode.get(f"{name}_nocache")
        if off is not None and off["output_tok_s"]:
            r["throughput_vs_nocache"] = round(r["output_tok_s"] / off["output_tok_s"], 3)
            if off.get("ttft_ms_p50"):
                r["ttft_p50_vs_nocache"] = round(r["ttft_ms_p50"] / off["ttft_ms_p50"], 3)
    for name, r in by_mode.items():
        if name.endswith("_nocache"):
            continue
        if not name.startswith("corun"):
            continue
        for peer in ("default", "batch_invariant", "batch_invariant_tuned"):
            if peer in by_mode and by_mode[peer]["output_tok_s"]:
                r[f"throughput_vs_{peer}"] = round(
                    r["output_tok_s"] / by_mode[peer]["output_tok_s"], 3)
                if by_mode[peer].get("ttft_ms_p50"):
                    r[f"ttft_p50_vs_{peer}"] = round(
                        r["ttft_ms_p50"] / by_mode[peer]["ttft_ms_p50"], 3)


def plot(records: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [r["mode"] for r in records]
    palette = {"default": "#999999", "batch_invariant": "#cc6666",
               "batch_invariant_tuned": "#aa3333"}
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, key, label in zip(axes, ("output_tok_s", "ttft_ms_p50", "tpot_ms_p50"),
                              ("output tokens/s", "TTFT p50 (ms)", "TPOT p50 (ms)"), strict=True):
        ax.bar(modes, [r.get(key) or 0 for r in records],
               color=[palette.get(m, "#3366cc") for m in modes])
        ax.set_title(label)
        ax.tick_params(axis="x", labelrotation=30, labelsize=7)
        if key == "output_tok_s":
            for i, r in enumerate(records):
                if "mismatches" in r:
                    ax.text(i, r.get(key) or 0, f"mism. {r['mismatches']}", ha="center",
                            va="bottom", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_overrides(items: list[str]) -> dict:
    """``key=value`` pairs for corun's EngineConfig (ints, bools, or strings)."""
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        if value.lower() in ("true", "false"):  # as given, or as Python prints a bool
            out[key] = value.lower() == "true"
        else:
            try:
                out[key] = int(value)
            except ValueError:
                out[key] = value
    return out


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an int >= 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default=None)
    parser.add_argument("--modes", nargs="+", default=list(HEADLINE), choices=list(VARIANTS))
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--input-len", type=int, nargs=2, default=(256, 2048))
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=256,
                        help="concurrency cap of every mode (and corun's B unless set)")
    parser.add_argument("--decode-batch-size", type=int, default=None, help="corun's B")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192,
                        help="the dynamic modes' token budget per step")
    parser.add_argument("--corun-set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="corun EngineConfig overrides, e.g. prefill_step_tokens=4096")
    parser.add_argument("--audit-requests", type=int, default=200)
    parser.add_argument("--audit-max-num-seqs", type=int, default=None, help="default: half")
    parser.add_argument("--alone-sample", type=int, default=16)
    parser.add_argument("--warmup-burst", type=int, default=32,
                        help="requests of the warm-up's burst (mixed steps at full budget)")
    parser.add_argument("--reruns-if-compiled", type=non_negative_int, default=1, metavar="N",
                        help="run a main run again (up to N times) if Triton compiled in it")
    parser.add_argument("--no-audit", action="store_true")
    parser.add_argument("--graph-check", type=int, default=0, metavar="N",
                        help="also run N short requests eagerly and from the graphs, compare")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.88)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default="offline-h200")
    parser.add_argument("--workload", choices=("random", "shared-prefix"), default="random",
                        help="random: prompt lengths in --input-len; shared-prefix: system "
                             "prompts x questions (--num-system-prompts, --system-len, "
                             "--question-len, --n-request)")
    parser.add_argument("--prefix-caching", choices=("on", "off", "both"), default="on",
                        help="both: every variant with caching on and off (compared)")
    parser.add_argument("--num-system-prompts", type=int, default=16)
    parser.add_argument("--system-len", type=int, nargs=2, default=(1024, 2048))
    parser.add_argument("--question-len", type=int, nargs=2, default=(16, 64))
    parser.add_argument("--n-request", type=int, default=8,
                        help="shared-prefix: one more request sampling n times (1: none)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.corun_overrides = parse_overrides(args.corun_set)
    args.audit_max_num_seqs = args.audit_max_num_seqs or max(1, args.max_num_seqs // 2)
    t0 = time.perf_counter()
    from models import build_model

    probe = engine_config(args.modes[0], args)
    model = build_model(args.model, dtype=probe.torch_dtype, device=probe.resolved_device,
                        seed=args.seed)
    vocab = model[1].vocab_size
    workload = {"num_requests": args.num_requests, "input_len": list(args.input_len),
                "output_len": args.output_len, "max_num_seqs": args.max_num_seqs,
                "arrivals": "all at t=0", "corun_overrides": args.corun_overrides,
                "kind": args.workload, "prefix_caching": args.prefix_caching}
    if args.workload == "shared-prefix":
        work = make_shared_prefix_workload(
            args.num_requests, args.num_system_prompts, tuple(args.system_len),
            tuple(args.question_len), args.output_len, args.n_request, vocab, args.seed)
        workload.update(num_system_prompts=args.num_system_prompts,
                        system_len=list(args.system_len), question_len=list(args.question_len),
                        n_request=args.n_request)
        del workload["input_len"]
    else:
        work = make_workload(args.num_requests, tuple(args.input_len), args.output_len, vocab,
                             args.seed)
    extra = {"model": args.model, "dtype": args.dtype, "workload": workload,
             "timing": "wall clock of the whole run; per-step profile with a device sync around "
                       "each step; decode bounds: the weights the step reads (no embedding; the "
                       "experts its live tokens reach under uniform routing) + the timed step's "
                       f"live KV, read once at {bandwidth_label()}"}
    records: list[dict] = []
    path = None
    cachings = {"on": (True,), "off": (False,), "both": (True, False)}[args.prefix_caching]
    for variant in args.modes:
        prints = {}
        for caching in cachings:
            record, prints[caching] = bench_variant(variant, model, args, work, caching)
            records.append(record)
            if len(prints) == 2:  # the cache-on record: its outputs against cache-off's
                records[-2]["mismatches_vs_nocache"] = sum(
                    prints[True][i] != prints[False][i] for i in prints[True])
            print(json.dumps(record), flush=True)
            gc.collect()
            if probe.is_cuda:
                torch.cuda.empty_cache()
            add_ratios(records)
            path = write_results(args.name, records, **extra)  # after every run: keep partials
    plot(records, path.with_suffix(".png"))
    print(f"wrote {path} in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
