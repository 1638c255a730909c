"""The engine's host work around a decode step's forward at B = 128: scheduling, committing the
sampled tokens (stop checks included) and building the step's outputs, with outputs built every
step (what the server streams) and only at the finish (``final_only``: LLM.generate, and
bench_offline since the fifth session of 2026-12-05).

The tiny Qwen3 on this CPU through the torch backend, with the embedded byte-level tokenizer:
the forward's own time is left out (it is the device's on a GPU), what is timed is the Python
the engine runs between two forwards, which a GPU waits through (the engine syncs on the sampled
tokens each step). Each stage is wrapped on the engine instance and timed with
``time.perf_counter``; the figures are medians over the decode steps (every sequence decoding)
of one run. A CPU measurement, named after the machine.

    python -m experiments.bench_engine_host [--batch 128] [--output-tokens 256]
        -> experiments/results/engine-host-cpu.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tqdm.auto import tqdm

from corun.llm import LLM
from corun.sampling_params import SamplingParams
from experiments.harness import write_results

STAGES = ("schedule", "forward", "commit", "outputs")


def _timed(record: dict[str, float], key: str, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            record[key] = record.get(key, 0.0) + time.perf_counter() - start
    return wrapper


def measure(batch: int, output_tokens: int, final_only: bool, stop: bool) -> dict:
    llm = LLM(model="tiny-qwen3", dtype="float32", device="cpu", backend="torch",
              max_num_seqs=batch, decode_batch_size=batch, block_size=16,
              max_model_len=64 + output_tokens)
    engine = llm.engine
    step_record: dict[str, float] = {}
    engine.scheduler.schedule = _timed(step_record, "schedule", engine.scheduler.schedule)
    engine.runner.forward = _timed(step_record, "forward", engine.runner.forward)
    engine._commit_part = _timed(step_record, "commit", engine._commit_part)
    engine._make_output = _timed(step_record, "outputs", engine._make_output)
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=output_tokens, ignore_eos=True,
                            stop=["\x00\x01"] if stop else None)
    prompts = [[(7 * i + j) % 200 + 1 for j in range(16)] for i in range(batch)]
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params, f"r{i}", final_only=final_only)
    per_step: list[dict[str, float]] = []
    while engine.has_unfinished_requests():
        step_record.clear()
        start = time.perf_counter()
        engine.step()
        step_record["step"] = time.perf_counter() - start
        decoding = len(engine.scheduler.running) == batch and all(
            not s.is_prefilling for s in engine.scheduler.running)
        if decoding:
            per_step.append(dict(step_record))
    llm.close()
    record = {"batch": batch, "output_tokens": output_tokens, "final_only": final_only,
              "stop_strings": stop, "decode_steps": len(per_step)}
    for key in (*STAGES, "step"):
        record[f"{key}_ms"] = round(statistics.median(s.get(key, 0.0) for s in per_step) * 1e3, 3)
    record["host_ms"] = round(statistics.median(
        s["step"] - s.get("forward", 0.0) for s in per_step) * 1e3, 3)
    return record


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--name", default="engine-host-cpu")
    args = parser.parse_args(argv)
    cases = [(final_only, stop) for stop in (False, True) for final_only in (False, True)]
    records = [measure(args.batch, args.output_tokens, final_only, stop)
               for final_only, stop in tqdm(cases, desc="cases")]
    path = write_results(
        args.name, records, model="tiny-qwen3 (torch backend, fp32), the embedded byte-level "
        "tokenizer", timing="host milliseconds a decode step, median over the steps where every "
        "sequence decodes (time.perf_counter around each engine stage); host_ms is the step's "
        "wall time less its forward")
    for r in records:
        print(r)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
