"""The client side of the serving benchmark, as ``vllm bench serve`` does it: seeded random
requests, their arrival schedule, one streamed ``/v1/completions`` request timed chunk by chunk,
a run of them, and vLLM's summary of the timings (``calculate_metrics``'s key names)."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestResult:
    """One request's timings, as vLLM's ``RequestFuncOutput``."""

    prompt_len: int
    success: bool = False
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0
    error: str = ""


def make_requests(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    vocab_range: int,
    seed: int,
) -> list[tuple[list[int], int, int]]:
    """(prompt token ids, max output tokens, request seed) per request; reproducible from seed."""
    rng = random.Random(seed)

    def length(mean: int) -> int:
        return max(
            1, rng.randint(int(mean * (1 - range_ratio)), int(math.ceil(mean * (1 + range_ratio))))
        )

    return [
        (
            [rng.randrange(vocab_range) for _ in range(length(input_len))],
            length(output_len),
            rng.randrange(2**63),
        )
        for _ in range(num_prompts)
    ]


async def send_request(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    prompt: list[int],
    output_len: int,
    seed: int,
    temperature: float,
) -> RequestResult:
    """Stream one completion and time its chunks."""
    result = RequestResult(prompt_len=len(prompt))
    payload = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "ignore_eos": True,
        "temperature": temperature,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    result.start_time = start
    last = start
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue  # blank separators and SSE comments
                data = line[len("data: ") :]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"])
                    return result
                now = time.perf_counter()
                if chunk.get("choices"):
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
        result.latency = last - start
        result.success = result.ttft > 0.0
        if not result.success:
            result.error = "no token chunk received"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = repr(exc)
    return result


def arrival_gaps(num: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Inter-arrival gaps in seconds: Gamma(burstiness, 1/(rate*burstiness)); zeros for inf."""
    if math.isinf(rate):
        return [0.0] * num
    rng = np.random.default_rng(seed)
    return list(rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num))


async def run_benchmark(
    base_url: str,
    model: str,
    requests: list[tuple[list[int], int, int]],
    rate: float,
    max_concurrency: int | None,
    burstiness: float,
    temperature: float,
    seed: int,
    deadline_s: float | None = None,
) -> tuple[list[RequestResult], float]:
    """Send ``requests`` on the arrival schedule; returns per-request results and the duration.

    With ``deadline_s``, no request starts after that many seconds (the rest count as not sent).
    """
    url = base_url.rstrip("/") + "/v1/completions"
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:

        async def limited(prompt: list[int], out_len: int, req_seed: int) -> RequestResult:
            if semaphore is None:
                return await send_request(
                    client, url, model, prompt, out_len, req_seed, temperature
                )
            async with semaphore:
                return await send_request(
                    client, url, model, prompt, out_len, req_seed, temperature
                )

        tasks = []
        start = time.perf_counter()
        for (prompt, out_len, req_seed), gap in zip(
            requests, arrival_gaps(len(requests), rate, burstiness, seed), strict=False
        ):
            if gap > 0:
                await asyncio.sleep(gap)
            if deadline_s is not None and time.perf_counter() - start > deadline_s:
                break
            tasks.append(asyncio.create_task(limited(prompt, out_len, req_seed)))
        results = list(await asyncio.gather(*tasks))
        return results, time.perf_counter() - start


def summarize(
    results: list[RequestResult], duration: float, percentiles: tuple[float, ...] = (99,)
) -> dict:
    """vLLM ``calculate_metrics``: totals, throughputs, and mean/median/std/pXX per metric in ms."""
    ok = [r for r in results if r.success]
    values: dict[str, list[float]] = {m: [] for m in METRICS}
    for r in ok:
        values["ttft"].append(r.ttft)
        values["itl"].extend(r.itl)
        values["e2el"].append(r.latency)
        if r.output_tokens > 1:
            values["tpot"].append((r.latency - r.ttft) / (r.output_tokens - 1))
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    record = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": total_out / duration if duration else 0.0,
        "total_token_throughput": (total_in + total_out) / duration if duration else 0.0,
        "max_concurrent_requests": _peak_concurrency(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
    }
    for metric, xs in values.items():
        arr = np.asarray(xs or [0.0]) * 1000.0
        record[f"mean_{metric}_ms"] = float(arr.mean())
        record[f"median_{metric}_ms"] = float(np.median(arr))
        record[f"std_{metric}_ms"] = float(arr.std())
        for p in percentiles:
            record[f"p{p:g}_{metric}_ms"] = float(np.percentile(arr, p))
    return record


def _peak_concurrency(results: list[RequestResult]) -> int:
    events = sorted(
        [(r.start_time, 1) for r in results] + [(r.start_time + r.latency, -1) for r in results]
    )
    peak = level = 0
    for _, delta in events:
        level += delta
        peak = max(peak, level)
    return peak
