"""Prometheus metrics of the server, named like vLLM's (``corun:`` instead of ``vllm:``).

Each server owns its own ``CollectorRegistry`` (no process-global registry: two servers in one
test process must not share counters). Counters and histograms are updated from the request
handlers (asyncio thread); the gauges are set by the engine loop thread after every step, from
``LLMEngine.stats()``, which is the only thread allowed to read the engine. The engine loop also
counts each step by kind with its wall time and scheduled tokens (``corun.step_timing``), the
split between prefill and decode time that request latencies do not show.
"""

from __future__ import annotations

import threading

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE  # noqa: N811
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Bucket edges in seconds, vLLM's: TTFT spans a CPU prefill of a long prompt, TPOT a fast GPU step.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
TPOT_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
)
E2E_BUCKETS = (
    0.01,
    0.05,
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
)

# Engine steps: a fast GPU decode step to a long CPU prefill.
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1,
                0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Tokens scheduled a step: powers of two up to 16k (a decode step's B to a packed prefill).
STEP_TOKEN_BUCKETS = tuple(float(1 << i) for i in range(15))
STEP_KINDS = ("prefill", "decode", "combined")

__all__ = ["CONTENT_TYPE", "ServerMetrics"]


class ServerMetrics:
    """All metrics of one server, labelled with the served model name."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        r = self.registry
        self.requests = Counter(
            "corun:request_success",
            "Finished requests, by finish reason.",
            [*labels, "finished_reason"],
            registry=r,
        )
        self.errors = Counter(
            "corun:request_errors",
            "Requests rejected before the engine, by HTTP status.",
            [*labels, "status"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "corun:prompt_tokens", "Prompt tokens prefilled.", labels, registry=r
        )
        self.generation_tokens = Counter(
            "corun:generation_tokens", "Tokens generated.", labels, registry=r
        )
        self.ttft = Histogram(
            "corun:time_to_first_token_seconds",
            "Time from arrival to the first token.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "corun:time_per_output_token_seconds",
            "Time between consecutive output tokens.",
            labels,
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "corun:e2e_request_latency_seconds",
            "Time from arrival to the last token.",
            labels,
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.running = Gauge(
            "corun:num_requests_running",
            "Sequences in the engine's running set.",
            labels,
            registry=r,
        )
        self.waiting = Gauge(
            "corun:num_requests_waiting",
            "Sequences waiting: in the engine's queue plus admitted but not yet handed to it.",
            labels,
            registry=r,
        )
        self.kv_blocks_used = Gauge(
            "corun:kv_cache_blocks_used", "KV cache blocks in use.", labels, registry=r
        )
        self.kv_blocks_total = Gauge(
            "corun:kv_cache_blocks_total", "KV cache blocks in the pool.", labels, registry=r
        )
        # vLLM's prefix-cache counters, in prompt tokens: looked up at admission / found cached.
        self.prefix_cache_queries = Counter(
            "corun:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            labels,
            registry=r,
        )
        self.prefix_cache_hits = Counter(
            "corun:prefix_cache_hits",
            "Prompt tokens found in the prefix cache (their prefill skipped).",
            labels,
            registry=r,
        )
        # Per engine step (the engine loop thread, after each step): where a server's time goes,
        # prefill against decode, which the request latencies alone do not tell apart.
        self.steps = Counter(
            "corun:engine_steps",
            "Engine steps that ran a forward, by kind (prefill, decode, combined: a decode part "
            "and a prefill part overlapped).",
            [*labels, "kind"],
            registry=r,
        )
        self.step_seconds = Histogram(
            "corun:engine_step_seconds",
            "Wall time of one engine step, from its schedule (or the previous forward's end) to "
            "its forward's end, by kind.",
            [*labels, "kind"],
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.step_tokens = Histogram(
            "corun:engine_step_tokens",
            "Tokens scheduled in one engine step (prompt chunks and decode tokens; not vLLM's "
            "iteration_tokens_total, which counts a prompt once, when its prefill ends).",
            labels,
            buckets=STEP_TOKEN_BUCKETS,
            registry=r,
        )
        for kind in STEP_KINDS:  # exported at 0 before the first step, as the token counters
            self.labels(self.steps, kind=kind)
            self.labels(self.step_seconds, kind=kind)
        self.labels(self.step_tokens)
        # A step's three series change together: a scrape sees all of a step or none of it.
        self._step_lock = threading.Lock()
        self._prefix_seen = (0, 0)  # the engine totals already counted
        # Exported at 0 from the first scrape on (a labelled counter has no sample until its
        # label is first used, so a scrape before any finished request would lack the series).
        for counter in (self.prompt_tokens, self.generation_tokens, self.prefix_cache_queries,
                        self.prefix_cache_hits):
            self.labels(counter)
        self.kv_usage = Gauge(
            "corun:kv_cache_usage_perc",
            "Fraction of KV cache blocks in use (1 = full).",
            labels,
            registry=r,
        )

    def labels(self, metric, **extra: str):
        return metric.labels(model_name=self.model_name, **extra)

    def observe_engine(self, running: int, waiting: int, kv_used: int, kv_total: int) -> None:
        """Set the gauges from one engine snapshot (called by the engine loop thread)."""
        self.labels(self.running).set(running)
        self.labels(self.waiting).set(waiting)
        self.labels(self.kv_blocks_used).set(kv_used)
        self.labels(self.kv_blocks_total).set(kv_total)
        self.labels(self.kv_usage).set(kv_used / kv_total if kv_total else 0.0)

    def observe_prefix_cache(self, queries: int, hits: int) -> None:
        """Advance the counters to the engine's running totals (engine loop thread)."""
        seen_queries, seen_hits = self._prefix_seen
        if queries > seen_queries:
            self.labels(self.prefix_cache_queries).inc(queries - seen_queries)
        if hits > seen_hits:
            self.labels(self.prefix_cache_hits).inc(hits - seen_hits)
        self._prefix_seen = (max(queries, seen_queries), max(hits, seen_hits))

    def observe_finished(
        self,
        finish_reason: str,
        prompt_len: int,
        output_len: int,
        ttft_s: float | None,
        e2e_s: float,
    ) -> None:
        """Record one finished sequence. The prompt is counted once per sequence it prefilled."""
        self.labels(self.requests, finished_reason=finish_reason).inc()
        self.labels(self.prompt_tokens).inc(prompt_len)
        self.labels(self.generation_tokens).inc(output_len)
        if ttft_s is not None:
            self.labels(self.ttft).observe(ttft_s)
        self.labels(self.e2e).observe(e2e_s)

    def observe_step(self, kind: str, num_tokens: int, seconds: float) -> None:
        """One engine step that ran a forward (engine loop thread)."""
        with self._step_lock:
            self.labels(self.steps, kind=kind).inc()
            self.labels(self.step_seconds, kind=kind).observe(seconds)
            self.labels(self.step_tokens).observe(num_tokens)

    def observe_itl(self, seconds: float) -> None:
        self.labels(self.tpot).observe(seconds)

    def observe_aborted(self, num_requests: int) -> None:
        """Sequences aborted because their client went away (or the stream failed)."""
        self.labels(self.requests, finished_reason="abort").inc(num_requests)

    def observe_error(self, status: int) -> None:
        self.labels(self.errors, status=str(status)).inc()

    def render(self) -> bytes:
        with self._step_lock:
            return generate_latest(self.registry)
