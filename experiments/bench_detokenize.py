"""Host cost of detokenizing a decode step's outputs: the whole output decoded again each step
(the engine before corun/detokenizer.py) against the incremental window it decodes now.

For each output length n, a batch of sequences that each hold n output tokens gains one token;
timed is the work ``LLMEngine._output_text`` does for that step across the batch: ``full``
decodes every sequence's n + 1 tokens, ``incremental`` calls ``IncrementalText.update`` on a
state that has followed the sequence token by token (vLLM's prefix / read offsets). The token
ids are the UTF-8 bytes of a multilingual text through the embedded default model's byte-level
tokenizer (one token a byte, so 1-4 tokens a character), and both decodes' texts are checked
equal. Medians of repeats with ``time.perf_counter``; a CPU measurement (no GPU involved), so
the file is named after the machine it ran on.

    python -m experiments.bench_detokenize [--batch 128] [--lengths 256 2048 8192]
        -> experiments/results/detokenize-cpu.json
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

from corun.default_model import build_tokenizer
from corun.detokenizer import IncrementalText
from experiments.harness import write_results

TEXT = "Deterministic inference — même résultat, 同じ結果, 相同的结果 🙂. "


def _median_us(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def measure(length: int, batch: int, repeats: int) -> dict:
    tokenizer = build_tokenizer()
    ids = list((TEXT * (length // len(TEXT.encode()) + 2)).encode())[: length + 1]

    def decode(token_ids):
        return tokenizer.decode(list(token_ids), skip_special_tokens=True)

    # Every sequence of the batch at the same length: a state that has followed n tokens.
    state = IncrementalText()
    for end in range(1, length + 1):
        state.update(decode, ids[:end])
    states = [state] * batch
    full_text = decode(ids)

    def full_step():
        for _ in range(batch):
            decode(ids)

    def incremental_step():
        # A copy each repeat, so every repeat times the same step (the n+1-th token arriving).
        for state in states:
            IncrementalText(state.text, state.prefix_offset, state.read_offset).update(decode, ids)

    check = IncrementalText(states[0].text, states[0].prefix_offset, states[0].read_offset)
    if check.update(decode, ids) != full_text:
        raise AssertionError(f"incremental text differs from the full decode at n={length}")
    full_us = _median_us(full_step, repeats)
    incremental_us = _median_us(incremental_step, repeats)
    return {"output_tokens": length, "batch": batch, "full_us": round(full_us, 1),
            "incremental_us": round(incremental_us, 1),
            "full_over_incremental": round(full_us / incremental_us, 1), "repeats": repeats}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 2048, 8192])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--name", default="detokenize-cpu")
    args = parser.parse_args(argv)
    records = [measure(n, args.batch, args.repeats) for n in tqdm(args.lengths, desc="lengths")]
    path = write_results(args.name, records, tokenizer="the embedded default model's (byte-level)",
                         timing="host microseconds of one decode step's detokenization for the "
                                "whole batch, median of repeats (time.perf_counter)")
    for r in records:
        print(r)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
