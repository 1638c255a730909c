"""What an offline run's outputs and step records say: latency percentiles, the per-kind step
profile, and each decode step against the memory bound of the very step that was timed."""

from __future__ import annotations

import statistics

import numpy as np

from corun.engine import StepRecord
from corun.model_runner import ModelRunner
from corun.outputs import RequestOutput
from experiments.bench_models import decode_weight_bytes
from experiments.harness import memory_bound_us


def percentile(values: list[float], q: float) -> float | None:
    """The q-quantile, linearly interpolated (numpy's default, as serving_client.summarize and
    vLLM's serving benchmark take percentiles); before 2026-12-05 it was the value at index
    int(q n), the upper middle value at p50 of an even count."""
    if not values:
        return None
    return round(float(np.percentile(values, q * 100)), 3)


def latency_stats(outputs: list[RequestOutput]) -> dict:
    ttft = [o.metrics.ttft_s * 1e3 for o in outputs]
    tpot = [o.metrics.tpot_s * 1e3 for o in outputs if o.metrics.tpot_s is not None]
    return {
        "ttft_ms_mean": round(statistics.fmean(ttft), 3), "ttft_ms_p50": percentile(ttft, 0.5),
        "ttft_ms_p99": percentile(ttft, 0.99),
        "tpot_ms_mean": round(statistics.fmean(tpot), 3) if tpot else None,
        "tpot_ms_p50": percentile(tpot, 0.5), "tpot_ms_p99": percentile(tpot, 0.99),
    }


def decode_bound_ms(runner: ModelRunner, context_tokens: float, live: float) -> float:
    """The weights a decode step of ``live`` tokens reads (``bench_models.decode_weight_bytes``:
    not the embedding, which is only gathered, nor the experts no token routes to) + the KV of
    ``context_tokens`` cached tokens, read once at the H200 bandwidth."""
    weight_bytes = decode_weight_bytes(runner.model_config, max(live, 1),
                                       runner.dtype.itemsize)
    kv_per_token = runner.kv_cache.spec.bytes_per_block(1, runner.dtype)
    return memory_bound_us(weight_bytes + context_tokens * kv_per_token) / 1e3


def step_profile(records: list[StepRecord], runner: ModelRunner) -> dict:
    """Per-kind step counts and median ms; each decode step against its own memory bound."""
    out: dict = {}
    for kind in ("prefill", "decode", "combined"):
        steps = [r for r in records if r.kind == kind]
        if not steps:
            continue
        out[f"{kind}_steps"] = len(steps)
        out[f"{kind}_step_ms_p50"] = percentile([r.seconds * 1e3 for r in steps], 0.5)
        out[f"{kind}_seconds"] = round(sum(r.seconds for r in steps), 3)
        if kind != "prefill":
            out[f"{kind}_live_mean"] = round(statistics.fmean(r.num_decode_live for r in steps), 2)
        if kind == "prefill":  # how full the fixed-shape prefill steps were
            out["prefill_real_token_fraction"] = round(
                sum(r.num_real_tokens for r in steps) / max(sum(r.num_tokens for r in steps), 1),
                3)
    decodes = [r for r in records if r.kind == "decode"]
    if decodes:
        ratios = [r.seconds * 1e3 / decode_bound_ms(runner, r.decode_context_tokens,
                                                    r.num_decode_live) for r in decodes]
        out["decode_step_over_own_bound_p50"] = percentile(ratios, 0.5)
        live = statistics.fmean(r.num_decode_live for r in decodes)
        context = statistics.fmean(r.decode_context_tokens for r in decodes)
        out["decode_live_mean"] = round(live, 2)
        out["decode_bound_ms_at_live_mean"] = round(decode_bound_ms(runner, context, live), 4)
    out["steps"] = len(records)
    return out
