"""The " Serving Benchmark Result " block that ``vllm bench serve`` prints, both ways.

``print_result`` writes a record as that block (bench_serving prints one after every rate, and log
parsers key on its strings); ``parse_result_blocks`` reads the blocks of a log back into records.
The second exists for runs that printed their rates and were stopped before they saved them:

    python -m experiments.serving_log LOG --into RESULTS.json [--mode default]

replaces the mode's records in ``RESULTS.json`` with the log's (the fields the block prints,
each record marked ``recovered_from_log``) and redraws its load curves (``ablate_serving.plot``).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

# (printed label, record key, format) in the block's order, then one section per latency metric.
SUMMARY_LINES = (
    ("Successful requests:", "completed", "{}"),
    ("Failed requests:", "failed", "{}"),
    ("Benchmark duration (s):", "duration", "{:.2f}"),
    ("Total input tokens:", "total_input_tokens", "{}"),
    ("Total generated tokens:", "total_output_tokens", "{}"),
    ("Request throughput (req/s):", "request_throughput", "{:.2f}"),
    ("Output token throughput (tok/s):", "output_throughput", "{:.2f}"),
    ("Peak concurrent requests:", "max_concurrent_requests", "{}"),
    ("Total Token throughput (tok/s):", "total_token_throughput", "{:.2f}"),
)
METRIC_TITLES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}
_STATS = (("Mean", "mean"), ("Median", "median"), ("P99", "p99"))
_LINE = "{:<40} {:<10}"
_RUN_LINE = re.compile(r"^mode=(\S+) rate=(\S+) max_concurrency=(\S+)\s*$")


def _metric_lines(metric: str) -> list[tuple[str, str, str]]:
    return [(f"{stat} {metric.upper()} (ms):", f"{key}_{metric}_ms", "{:.2f}")
            for stat, key in _STATS]


def _lines() -> list[tuple[str, str, str]]:
    return [*SUMMARY_LINES, *(line for metric in METRIC_TITLES for line in _metric_lines(metric))]


def print_result(record: dict) -> None:
    """The block ``vllm bench serve`` prints (log parsers key on these strings)."""
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    for label, key, fmt in SUMMARY_LINES:
        print(_LINE.format(label, fmt.format(record[key])))
    for metric, title in METRIC_TITLES.items():
        print("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        for label, key, fmt in _metric_lines(metric):
            print(_LINE.format(label, fmt.format(record[key])))
    print("=" * 50)


def _number(line: str, value: str) -> int | float:
    try:
        return float(value) if any(c in value for c in ".en") else int(value)
    except ValueError:
        raise ValueError(f"expected a number after the label in the line {line!r}") from None


def parse_result_blocks(text: str) -> list[dict]:
    """Every ``mode=... rate=...`` line of a bench_serving log with the block printed after it:
    mode, request_rate (a float, or ``"inf"``), max_concurrency and the block's fields. Other
    lines in between (a server's access log) are skipped; a block cut before its closing rule
    is left out, and a (mode, rate, concurrency) printed twice keeps its last block."""
    labels = {label: key for label, key, _ in _lines()}
    records: dict[tuple, dict] = {}
    current = None
    for line in text.replace("\r", "\n").splitlines():
        run = _RUN_LINE.match(line)
        if run:
            mode, rate, concurrency = run.groups()
            current = {"mode": mode, "request_rate": rate if rate == "inf" else float(rate),
                       "max_concurrency": None if concurrency == "None" else int(concurrency)}
            continue
        if current is None:
            continue
        if line.strip() == "=" * 50:
            if len(current) == 3 + len(labels):  # every printed field was read
                key = (current["mode"], current["request_rate"], current["max_concurrency"])
                records.pop(key, None)
                records[key] = current
            current = None
            continue
        for label, key in labels.items():
            if line.startswith(label):
                current[key] = _number(line, line[len(label):].strip())
                break
    return list(records.values())


def recover(log: Path, into: Path, mode: str | None) -> list[dict]:
    """Replace ``mode``'s records in the results file ``into`` with the log's (see module doc)."""
    head, *records = json.loads(into.read_text())
    found = [r for r in parse_result_blocks(log.read_text()) if mode in (None, r["mode"])]
    if not found:
        raise ValueError(f"{log}: no complete result block{f' of mode {mode}' if mode else ''}")
    args = head.get("args", {})
    recovered = [{"label": r["mode"], **r, "model": args.get("model"),
                  "random_input_len": int(args.get("random_input_len", 0)),
                  "random_output_len": int(args.get("random_output_len", 0)),
                  "num_prompts": r["completed"] + r["failed"],
                  "recovered_from_log": f"{log.name}: the fields its result block prints "
                                        "(the run was stopped before it saved them)"}
                 for r in found]
    modes = {r["mode"] for r in recovered}
    kept = [r for r in records if r.get("mode") not in modes]
    # Recovering the same log again replaces its entry rather than adding a second one.
    head["recovered"] = [*(r for r in head.get("recovered", []) if r["log"] != log.name),
                         {"log": log.name, "modes": sorted(modes), "points": len(recovered)}]
    into.write_text(json.dumps([head, *kept, *recovered], indent=1) + "\n")
    return recovered


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", type=Path)
    parser.add_argument("--into", type=Path, required=True, help="a bench_serving results file")
    parser.add_argument("--mode", default=None, help="only this mode's blocks")
    args = parser.parse_args(argv)
    recovered = recover(args.log, args.into, args.mode)
    from experiments import ablate_serving

    ablate_serving.plot(json.loads(args.into.read_text())[1:], args.into.with_suffix(".png"))
    print(f"recovered {len(recovered)} records into {args.into}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
