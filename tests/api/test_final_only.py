"""A response that is not streamed asks the engine for its finished outputs only (vLLM's
FINAL_ONLY): the engine builds and hands over one output a request, and the latency metrics come
from the engine's commit times of its tokens, as many gaps as a stream of it records."""

from __future__ import annotations

import collections
import json
import threading
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

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


def _histogram_counts(url: str) -> collections.Counter:
    """Observations per histogram (absent: a labelled histogram has no sample before its first)."""
    text = httpx.get(f"{url}/metrics", timeout=10.0).text
    return collections.Counter({s.name: s.value for family in text_string_to_metric_families(text)
                                for s in family.samples if s.name.endswith("_count")})


def test_a_whole_response_gets_one_engine_output_and_the_stream_every_step():
    engine, tokenizer = build_engine()
    counting = CountingEngine(engine)
    body = {"prompt": "Hello there", "max_tokens": 6, "ignore_eos": True, "seed": 3,
            "temperature": 0.8, "return_token_ids": True}
    ttft = "corun:time_to_first_token_seconds_count"
    itl = "corun:time_per_output_token_seconds_count"
    with serve_in_thread(counting, tokenizer) as url:
        before = _histogram_counts(url)
        whole = httpx.post(f"{url}/v1/completions", json=body, timeout=60.0).json()
        after_whole = _histogram_counts(url)
        seen_whole = counting.counts()
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True},
                          timeout=60.0) as response:
            chunks = [json.loads(line[len("data: "):]) for line in response.iter_lines()
                      if line.startswith("data: {")]
            streamed = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        after_stream = _histogram_counts(url)
        seen = counting.counts()
    assert len(whole["choices"][0]["token_ids"]) == 6
    assert list(seen_whole.values()) == [1]  # one request, one output: its finished one
    streamed_id = (set(seen) - set(seen_whole)).pop()
    assert seen[streamed_id] >= 6  # a stream hears every step
    assert streamed == whole["choices"][0]["text"]
    # Both record a TTFT and 5 inter-token gaps for their 6 tokens.
    assert after_whole[ttft] - before[ttft] == 1 == after_stream[ttft] - after_whole[ttft]
    assert after_whole[itl] - before[itl] == 5 == after_stream[itl] - after_whole[itl]
