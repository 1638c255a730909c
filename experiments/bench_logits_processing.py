"""Cost of a step's logits processing (penalties, bias, min_tokens, min_p): the rows that ask for
it processed together (``corun.logits_processing.process_rows``, one launch per processor and
distinct parameter value in each block of rows) against the same rows processed one at a time
(the engine's form before).

For each batch size B, B sequences that each hold ``--output-tokens`` output tokens gain one
token and their step's [B, V] logits are processed, four ways: row by row; ``batched``, as
``process_rows`` runs on this device; ``gpu_blocks``, in the blocks a GPU runs
(``BLOCK_BYTES``); ``one_block``, every row at once. Counted: the aten ops the step dispatches
(``count_aten_ops``; on a GPU each is a kernel launch, a copy or a view), and timed: the step's
wall time (median of repeats, ``time.perf_counter``, after a synchronize on CUDA). Every form's
rows are checked bit-equal to row by row's before anything is timed. Two workloads:

- ``repetition``: every row with a Qwen2.5 checkpoint's generation config (repetition_penalty
  1.05, temperature 0.7), which the server applies to every request that does not override it;
- ``mixed``: rows drawn from a few values of every processor, so rows share some values and not
  others.

On the CPU the wall time is the ops' arithmetic over B x V entries and the memory it maps; the
op count is what a GPU's host pays a launch for.

    python -m experiments.bench_logits_processing [--device cpu] [--batches 1 8 32 128]
        -> experiments/results/logits-processing-<device>.json
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from tqdm.auto import tqdm

from corun.logits_processing import (
    BLOCK_BYTES,
    CPU_BLOCK_BYTES,
    PenaltyPool,
    _process_block,
    process_rows,
)
from corun.sampling_params import SamplingParams
from corun.sequence import Sequence
from experiments.harness import write_results

VOCAB = 151936  # Qwen2.5 / Qwen3


class count_aten_ops(TorchDispatchMode):  # noqa: N801 - used as a context manager
    """Counts the aten ops dispatched inside the ``with`` block (``.count``)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def workload_params(workload: str, batch: int, rng: random.Random,
                    vocab: int = VOCAB) -> list[SamplingParams]:
    if workload == "repetition":
        return [SamplingParams(repetition_penalty=1.05, temperature=0.7, top_p=0.8, top_k=20)
                for _ in range(batch)]
    if workload == "mixed":
        return [SamplingParams(repetition_penalty=rng.choice((1.0, 1.05, 1.3)),
                               frequency_penalty=rng.choice((0.0, 0.4)),
                               presence_penalty=rng.choice((0.0, 0.7)),
                               min_p=rng.choice((0.0, 0.05)), temperature=0.8,
                               logit_bias={rng.randrange(vocab): 2.0} if rng.random() < 0.3 else {},
                               min_tokens=0)
                for _ in range(batch)]
    raise ValueError(f"workload: expected 'repetition' or 'mixed', got {workload!r}")


def _sequences(params: list[SamplingParams], output_tokens: int, vocab: int,
               rng: random.Random) -> list[Sequence]:
    seqs = []
    for i, p in enumerate(params):
        seq = Sequence(i, "r", 0, [rng.randrange(vocab) for _ in range(256)], p, seed=i)
        for _ in range(output_tokens):
            seq.append_token(rng.randrange(vocab))
        seqs.append(seq)
    return seqs


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(workload: str, batch: int, device: torch.device, output_tokens: int, repeats: int,
            vocab: int = VOCAB) -> dict:
    rng = random.Random(batch)
    params = workload_params(workload, batch, rng, vocab)
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(batch)).to(device)
    forms = {
        "batched": lambda seqs, pool: process_rows(logits, seqs, pool),
        "row_at_a_time": lambda seqs, pool: torch.cat(
            [process_rows(logits[i:i + 1], [s], pool) for i, s in enumerate(seqs)]),
        # The blocks a GPU runs (corun.logits_processing.BLOCK_BYTES), and every row in one.
        "gpu_blocks": lambda seqs, pool: process_rows(logits, seqs, pool, BLOCK_BYTES),
        "one_block": lambda seqs, pool: _process_block(logits, seqs, pool),
    }
    record = {"workload": workload, "batch": batch, "vocab": vocab,
              "output_tokens": output_tokens, "repeats": repeats}
    outputs = {}
    for name, form in forms.items():
        seqs = _sequences(params, output_tokens, vocab, random.Random(batch + 1))
        pool = PenaltyPool(device)
        step_rng = random.Random(batch + 2)  # the same new tokens for both forms
        form(seqs, pool)  # the pool's first step builds every row from its tokens
        times = []
        for repeat in range(repeats + 1):  # each: one more token a sequence, then the step
            for seq in seqs:
                seq.append_token(step_rng.randrange(vocab))
            _sync(device)
            if repeat == 0:  # counted, not timed: the dispatch mode costs Python every op
                with count_aten_ops() as counter:
                    out = form(seqs, pool)
                continue
            start = time.perf_counter()
            out = form(seqs, pool)
            _sync(device)
            times.append(time.perf_counter() - start)
        ops = counter.count
        outputs[name] = out
        record[f"{name}_ops"] = ops
        record[f"{name}_ms"] = round(statistics.median(times) * 1e3, 3)
    for name in ("batched", "gpu_blocks", "one_block"):
        if not torch.equal(outputs[name].view(torch.int32),
                           outputs["row_at_a_time"].view(torch.int32)):
            raise AssertionError(f"{workload} B={batch}: {name} rows differ from one at a time")
    record["ops_ratio"] = round(record["row_at_a_time_ops"] / record["batched_ops"], 1)
    record["gpu_blocks_ops_ratio"] = round(
        record["row_at_a_time_ops"] / record["gpu_blocks_ops"], 1)
    record["time_ratio"] = round(record["row_at_a_time_ms"] / record["batched_ms"], 2)
    return record


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--workloads", nargs="+", default=["repetition", "mixed"])
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--name", default=None, help="default: logits-processing-<device type>")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    cases = [(w, b) for w in args.workloads for b in args.batches]
    records = [measure(w, b, device, args.output_tokens, args.repeats, args.vocab)
               for w, b in tqdm(cases, desc="cases")]
    name = args.name or f"logits-processing-{device.type}"
    path = write_results(
        name, records, device=str(device),
        timing="wall milliseconds of one step's logits processing for the batch, median of "
               "repeats (time.perf_counter; on CUDA, synchronized before and after)",
        ops="aten ops the step dispatches (TorchDispatchMode), views included; the first step, "
            "which builds each sequence's penalty row from its tokens, is not counted; "
            "'batched' is process_rows as it runs on this device (in blocks of BLOCK_BYTES, "
            "CPU_BLOCK_BYTES on the CPU), 'gpu_blocks' in blocks of BLOCK_BYTES, as on a GPU, "
            "'one_block' every row at once",
        block_bytes=BLOCK_BYTES, cpu_block_bytes=CPU_BLOCK_BYTES)
    for r in records:
        print(r)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
