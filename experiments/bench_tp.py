"""Tensor parallelism: TP=1 vs TP=N in the three modes, and the cost of the rank-order reduction.

Two parts, one results file (``experiments/results/tp-<device>.json``, header + records):

- **reduce**: one all-reduce of a ``[tokens, hidden]`` activation (the row-parallel o_proj / down
  output) on N ranks, timed per policy of ``models.parallel``: ``all_reduce`` (NCCL's, what
  default and corun at 2 ranks use) vs ``rank_order`` (all_gather, then a sum in rank order in
  fp32: batch_invariant, and corun past 2 ranks). Token counts cover decode batches and prefill
  chunks. Every rank runs the same fixed number of iterations (``do_bench`` picks its repetition
  count by timing, which could differ between ranks and deadlock a collective), timed with CUDA
  events (the CPU: perf_counter), median over iterations, rank 0's figure.
- **engine**: the offline engine at TP=1 and TP=N, every mode, one workload (seeded prompts,
  greedy and sampled requests, EOS ignored): output tokens/s and TPOT p50; TP=N's greedy token ids
  against TP=1's (same model, so they should agree but for near-ties); under the deterministic
  modes the same workload rerun in reversed arrival order must keep every fingerprint
  (``mismatches``).

    python -m experiments.bench_tp --tp 2                      # two H200s: qwen3-8b shape, bf16
    python -m experiments.bench_tp --tp 2 --device cpu --dtype float32 --model tiny-qwen3 \\
        --num-requests 4 --input-len 16 --output-len 8 --tokens 1 16 --name tp-cpu-smoke
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from corun import LLM, SamplingParams
from experiments.harness import write_results
from kernels.mode import Mode
from models.config import NAMED_CONFIGS
from models.parallel import ParallelContext, ReducePolicy, all_reduce_rank_order, spawn_workers

MODES = ("corun", "batch_invariant", "default")


def _time_reduce(parallel: ParallelContext, hidden: int, tokens: list[int], dtype: torch.dtype,
                 device: str, iters: int) -> list[dict]:
    """Worker: per token count and policy, the median time of one reduction on this rank."""
    import torch.distributed as dist

    is_cuda = device == "cuda"
    dev = torch.device("cuda", parallel.rank) if is_cuda else torch.device("cpu")
    records = []
    for num_tokens in tokens:
        x = torch.randn(num_tokens, hidden, dtype=dtype, device=dev)
        for policy in ReducePolicy:
            def reduce(policy=policy, x=x):
                if policy is ReducePolicy.ALL_REDUCE:
                    y = x.clone()
                    dist.all_reduce(y)
                    return y
                return all_reduce_rank_order(x, parallel.world_size)

            times = []
            for i in range(iters + 5):  # the first 5 warm up
                dist.barrier()
                if is_cuda:
                    start, end = torch.cuda.Event(True), torch.cuda.Event(True)
                    start.record()
                    reduce()
                    end.record()
                    end.synchronize()
                    elapsed_us = start.elapsed_time(end) * 1e3
                else:
                    t0 = time.perf_counter()
                    reduce()
                    elapsed_us = (time.perf_counter() - t0) * 1e6
                if i >= 5:
                    times.append(elapsed_us)
            records.append({"part": "reduce", "tokens": num_tokens, "hidden": hidden,
                            "policy": policy.value, "us": round(statistics.median(times), 2)})
    return records


def bench_reduce(args: argparse.Namespace) -> list[dict]:
    hidden = NAMED_CONFIGS[args.model].hidden_size
    dtype = getattr(torch, args.dtype)
    results = spawn_workers(_time_reduce, args.tp,
                            (hidden, args.tokens, dtype, args.device, args.iters),
                            backend="nccl" if args.device == "cuda" else "gloo",
                            timeout_s=600, num_threads=None if args.device == "cuda" else 1)
    records = results[0]
    by_key = {(r["tokens"], r["policy"]): r["us"] for r in records}
    for r in records:  # the rank-order sum's cost relative to the plain all-reduce
        r["vs_all_reduce"] = round(r["us"] / by_key[r["tokens"], "all_reduce"], 3)
        r["world_size"] = args.tp
    return records


def make_workload(args: argparse.Namespace) -> tuple[list[list[int]], list[SamplingParams]]:
    gen = torch.Generator().manual_seed(args.seed)
    vocab = NAMED_CONFIGS[args.model].vocab_size
    prompts = [torch.randint(0, vocab, (args.input_len,), generator=gen).tolist()
               for _ in range(args.num_requests)]
    params = [SamplingParams(max_tokens=args.output_len, ignore_eos=True, seed=i,
                             temperature=0.0 if i % 2 == 0 else 0.8)
              for i in range(args.num_requests)]
    return prompts, params


def bench_engine(args: argparse.Namespace, mode: str, tp: int, greedy_ref: dict) -> dict:
    prompts, params = make_workload(args)
    kwargs = dict(mode=mode, tensor_parallel_size=tp, dtype=args.dtype, device=args.device,
                  max_num_seqs=args.max_num_seqs, max_model_len=args.input_len + args.output_len,
                  prefill_chunk_size=args.prefill_chunk_size,
                  max_num_batched_tokens=max(args.prefill_chunk_size, args.max_num_seqs))
    if args.device == "cpu":
        kwargs["backend"] = "torch"
    with LLM(args.model, **kwargs) as llm:
        llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # warm up
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        rerun = list(reversed(llm.generate(prompts[::-1], params[::-1], use_tqdm=False)))
    tpots = [(o.metrics.finish_time - o.metrics.first_token_time) / max(1, len(o.token_ids) - 1)
             for o in outs]
    greedy = {i: o.token_ids for i, o in enumerate(outs) if params[i].is_greedy}
    if tp == 1:
        greedy_ref[mode] = greedy
    record = {
        "part": "engine", "mode": mode, "tp": tp, "model": args.model,
        "output_tokens_per_s": round(sum(len(o.token_ids) for o in outs) / elapsed, 2),
        "tpot_p50_ms": round(statistics.median(tpots) * 1e3, 3),
        "mismatches": sum(a.fingerprint != b.fingerprint for a, b in zip(outs, rerun,
                                                                           strict=True)),
    }
    if tp != 1 and mode in greedy_ref:
        record["greedy_equal_to_tp1"] = sum(greedy[i] == greedy_ref[mode][i] for i in greedy)
        record["greedy_requests"] = len(greedy)
    return record


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size N compared with 1")
    p.add_argument("--model", default="qwen3-8b", help="a named config of models/")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 128, 512, 2048],
                   help="token counts of the reduction part")
    p.add_argument("--iters", type=int, default=50, help="timed reductions per point")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--prefill-chunk-size", type=int, default=512)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default=None, help="results file name (default tp-<device>)")
    args = p.parse_args()
    records = bench_reduce(args)
    for r in records:
        print(r)
    greedy_ref: dict = {}
    for mode in args.modes:
        Mode.parse(mode, "mode")
        for tp in (1, args.tp):
            records.append(bench_engine(args, mode, tp, greedy_ref))
            print(records[-1])
    path = write_results(args.name or f"tp-{'h200' if args.device == 'cuda' else 'cpu'}",
                         records, tp=args.tp, model=args.model)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
