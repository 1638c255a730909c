"""README views of the kernel results that gather several records into one line: issue 13's
targets as measured (``kernels-h200-targets``) and a decode step before and after a change of
the tuned tables (``models-h200-b128-after``). Looked up by ``experiments.report``."""

from __future__ import annotations

import statistics
from collections.abc import Callable

from experiments.report import _fmt, _load, _source, _table


def _timed(records: list[dict], op: str, **match: object) -> list[dict]:
    return [r for r in records if r.get("op") == op and "us" in r and not r.get("superseded")
            and not r.get("error") and all(r.get(k) == v for k, v in match.items())]


def _stats(values: list[float]) -> tuple[float, float, float]:
    return min(values), statistics.median(values), max(values)


def _gemm_at(records: list[dict], m: int) -> tuple[str, bool]:
    low, mid, _ = _stats([r["ratio"] for r in _timed(records, "gemm", policy="corun", M=m)])
    return f"M {m}: median {mid:.2f}, min {low:.2f}", mid >= 0.95 and low >= 0.85


def _rows(records: list[dict]) -> list[list[str]]:
    rows = []
    at_128, ok_128 = _gemm_at(records, 128)
    at_256, ok_256 = _gemm_at(records, 256)
    rows.append(["corun GEMM at M = 128 / 256 vs cuBLAS", "median >= 0.95, min >= 0.85",
                 f"{at_128}; {at_256}", ok_128 and ok_256])
    deepseek = [r for r in _timed(records, "gemm", policy="corun")
                if str(r.get("layer", "")).startswith("deepseek-v3.")]
    worst = min(deepseek, key=lambda r: r["ratio"])
    low, mid, _ = _stats([r["ratio"] for r in deepseek])
    rows.append(["corun GEMM, DeepSeek-V3 shapes, every M", ">= 0.85 every shape",
                 f"min {low:.2f} ({worst['layer']} at M {worst['M']}), median {mid:.2f}, "
                 f"{sum(r['ratio'] >= 0.85 for r in deepseek)} of {len(deepseek)} at >= 0.85",
                 low >= 0.85])
    sample = [r["ratio"] for r in _timed(records, "sample", policy="corun", target=True)]
    low, mid, _ = _stats(sample)
    rows.append(["sampling vs torch softmax + exponential race (vocab 152k and 129k, B 1-256)",
                 "median >= 1.0, min >= 0.8", f"median {mid:.2f}, min {low:.2f}",
                 mid >= 1.0 and low >= 0.8])
    mla = [r for r in _timed(records, "mla_decode") if r["batch"] >= 32 and r["context"] >= 1024]
    for policy in ("corun_split512", "default"):
        rs = [r for r in mla if r["policy"] == policy]
        low, _, high = _stats([r["bw_fraction"] for r in rs])
        floor_low, _, floor_high = _stats([r["compute_floor_us"] / r["bound_us"] for r in rs])
        peak_low, _, peak_high = _stats([r["compute_floor_us"] / r["us"] for r in rs])
        rows.append([f"MLA decode, {policy} (128 heads, absorbed), B >= 32, ctx >= 1024",
                     ">= 0.5 of the memory bound",
                     f"{low:.2f}-{high:.2f} of the memory bound. The MMA floor (the FLOPs at "
                     f"the measured dense peak) is {floor_low:.2f}-{floor_high:.2f}x that bound, "
                     f"so the target asks for {floor_low / 2:.2f}-{floor_high / 2:.2f} of the "
                     f"peak; the kernel runs at {peak_low:.2f}-{peak_high:.2f} of it",
                     low >= 0.5])
    low, _, high = _stats([r["ratio"] for r in _timed(records, "mla_prefill", policy="corun")])
    rows.append(["MLA prefill vs SDPA (v padded)", ">= 0.9", f"{low:.2f}-{high:.2f}", low >= 0.9])
    rope = [r["bw_fraction"] for r in _timed(records, "rope", shape="deepseek-v3")]
    low, mid, high = _stats(rope)
    rows.append(["RoPE, DeepSeek 64-dim rope x 128 heads, M 1-8192", ">= 0.6 of the bound",
                 f"median {mid:.2f}, {low:.2f}-{high:.2f}", mid >= 0.6])
    attention = [r["bw_fraction"] for r in _timed(records, "decode_attention", policy="corun")
                 if r.get("target")]
    low, mid, high = _stats(attention)
    rows.append(["decode attention at B <= 8 (the benchmark's target rows)",
                 ">= 0.6 of the bound", f"{low:.2f}-{high:.2f}, median {mid:.2f}", low >= 0.6])
    align = _timed(records, "moe_align", policy="corun")
    low, mid, _ = _stats([r["ratio"] for r in align])
    launches = max(len(r.get("launches_us") or {}) for r in _timed(records, "moe_align_variant"))
    rows.append(["MoE token sort before the grouped GEMM", "one kernel, graph-capturable",
                 f"{launches} launches (count, scatter), captured in the decode graphs; "
                 f"{low:.2f}-{mid:.2f}x faster than the torch sort (min, median)", launches == 1])
    return [[what, target, measured, "yes" if met else "no"]
            for what, target, measured, met in rows]


def kernels_targets_block(head: dict, records: list[dict]) -> str:
    """Issue 13's target rows, each computed from the records named beside it."""
    return "\n".join([_source(head, "kernels-h200"), "",
                      _table(["kernel", "target", "measured", "met"], _rows(records))])


def decode_step_change_block(head: dict, records: list[dict]) -> str:
    """bench_models' decode step, the same build timed before and after a change of the tuned
    tables: ``models-h200-b128-before`` beside this file (``-after``), one row per model."""
    before_head, before = _load("models-h200-b128-before") or ({}, [])
    earlier = {r["model"]: r for r in before}
    rows = []
    for r in records:
        old = earlier.get(r["model"], {})
        rows.append([r["model"], r["decode_batch"], r["decode_context"],
                     _fmt(old.get("decode_step_us"), 1), _fmt(r["decode_step_us"], 1),
                     _fmt(r["decode_step_us"] / old["decode_step_us"], 3) if old else "—",
                     _fmt(old.get("decode_fraction_of_bound")),
                     _fmt(r["decode_fraction_of_bound"])])
    return "\n".join([
        "before: " + _source(before_head, "models-h200-b128-before"),
        "", "after: " + _source(head, "models-h200-b128-after"), "",
        _table(["model", "B", "context", "decode step us (before)", "(after)", "after / before",
                "of memory bound (before)", "(after)"], rows)])


VIEWS: dict[str, Callable[[dict, list[dict]], str]] = {
    "kernels-h200-targets": kernels_targets_block,
    "models-h200-b128-after": decode_step_change_block,
}
ALIASES = {"kernels-h200-targets": "kernels-h200"}
