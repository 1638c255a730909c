"""A response that is not streamed asks the engine for its finished outputs only (vLLM's
FINAL_ONLY): the engine builds and hands over one output a request, and the latency metrics come
from the engine's commit times of its tokens, as many gaps as a stream of it records."""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.api.client import raw_completion, stream_chunks
from tests.api.inprocess import build_engine, serve_in_thread


@dataclass
class CountingEngine:
    """Delegates to ``engine``; counts the outputs each request id gets from ``step``."""

    engine: Any
    outputs: collections.Counter = field(default_factory=collections.Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def step(self) -> list:
        outputs = self.engine.step()
        with self.lock:
            self.outputs.update(o.request_id for o in outputs)
        return outputs

    def counts(self) -> dict[str, int]:
        with self.lock:
            return dict(self.outputs)


def _samples(url: str) -> collections.Counter:
    """Prometheus samples by name, ``[finished_reason]`` appended where labelled so (absent: a
    labelled metric has no sample before its first observation)."""
    text = httpx.get(f"{url}/metrics", timeout=10.0).text
    out: collections.Counter = collections.Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            reason = sample.labels.get("finished_reason")
            out[sample.name + (f"[{reason}]" if reason else "")] = sample.value
    return out


def test_a_whole_response_gets_one_engine_output_and_the_stream_every_step():
    engine, tokenizer = build_engine()
    counting = CountingEngine(engine)
    body = {"prompt": "Hello there", "max_tokens": 6, "ignore_eos": True, "seed": 3,
            "temperature": 0.8, "return_token_ids": True}
    ttft = "corun:time_to_first_token_seconds_count"
    itl = "corun:time_per_output_token_seconds_count"
    with serve_in_thread(counting, tokenizer) as url:
        before = _samples(url)
        whole = httpx.post(f"{url}/v1/completions", json=body, timeout=60.0).json()
        after_whole = _samples(url)
        seen_whole = counting.counts()
        with httpx.Client(base_url=url, timeout=60.0) as client:
            chunks = stream_chunks(client, "/v1/completions", body)
        streamed = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        after_stream = _samples(url)
        seen = counting.counts()
    assert len(whole["choices"][0]["token_ids"]) == 6
    assert list(seen_whole.values()) == [1]  # one request, one output: its finished one
    streamed_id = (set(seen) - set(seen_whole)).pop()
    assert seen[streamed_id] >= 6  # a stream hears every step
    assert streamed == whole["choices"][0]["text"]
    # Both record a TTFT and 5 inter-token gaps for their 6 tokens.
    assert after_whole[ttft] - before[ttft] == 1 == after_stream[ttft] - after_whole[ttft]
    assert after_whole[itl] - before[itl] == 5 == after_stream[itl] - after_whole[itl]


@dataclass
class HoldingEngine:
    """Delegates to ``engine``; once a request holds ``tokens`` output tokens, ``step`` sets
    ``reached`` and waits for ``release`` before it returns (the engine thread is held there)."""

    engine: Any
    tokens: int = 3
    reached: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def step(self) -> list:
        outputs = self.engine.step()
        if not self.reached.is_set() and any(
                len(s.output_ids) >= self.tokens
                for r in self.engine.requests.values() for s in r.seqs):
            self.reached.set()
            assert self.release.wait(60), "the test never released the engine"
        return outputs


def _wait_for(url: str, ready, what: str) -> collections.Counter:
    """Poll /metrics until ``ready(counts)``; the deadline only bounds a failed wait."""
    import time

    deadline = time.monotonic() + 60
    while not ready(counts := _samples(url)):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return counts


def test_a_whole_response_whose_client_left_still_records_its_gaps():
    """The engine loop records a final-only request's inter-token gaps from its last output,
    which an aborted request still gets though nobody reads it: 3 tokens, 2 gaps."""
    engine, tokenizer = build_engine()
    holding = HoldingEngine(engine)
    body = {"prompt": "tell me everything", "max_tokens": 100, "ignore_eos": True, "seed": 1}
    itl = "corun:time_per_output_token_seconds_count"
    aborted = "corun:request_success_total[abort]"
    with serve_in_thread(holding, tokenizer) as url:
        before = _samples(url)
        with raw_completion(url, body):
            assert holding.reached.wait(60)
        try:  # the server notices the client left (it counts the abort), then the engine goes on
            _wait_for(url, lambda c: c[aborted] > before[aborted], "the abort")
        finally:
            holding.release.set()
        after = _wait_for(url, lambda c: c[itl] > before[itl], "the gaps")
    assert after[itl] - before[itl] == 2
