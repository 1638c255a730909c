"""64 clients at once, each request mixing the features evaluation and RL users need (top-N
logprobs, echo + prompt logprobs, max_tokens 0 scoring, prompt_logprobs, penalties, logit_bias,
min_tokens, min_p, best_of, n, stop strings, chat, streaming, structured output): everything is
answered, and every response is identical to its replay alone (the drawn seed reused where the
client gave none)."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from tests.api.inprocess import build_engine, serve_in_thread

pytestmark = pytest.mark.timeout(600)

NUM_CLIENTS = 64


@pytest.fixture(scope="module")
def url():
    engine, tokenizer = build_engine("--max-num-seqs", "16")
    with serve_in_thread(engine, tokenizer) as base_url:
        yield base_url


def _requests(rng: random.Random) -> list[tuple[str, dict]]:
    out = []
    for i in range(NUM_CLIENTS):
        kind = i % 8
        words = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "x", "yz"])
                         for _ in range(rng.randint(1, 12)))
        extras = {
            "presence_penalty": rng.choice([0.0, 0.5, -1.0]),
            "frequency_penalty": rng.choice([0.0, 0.8]),
            "repetition_penalty": rng.choice([1.0, 1.3]),
            "min_p": rng.choice([0.0, 0.05]),
            "min_tokens": rng.choice([0, 2]),
            "temperature": rng.choice([0.0, 0.7, 1.0]),
            "top_k": rng.choice([0, 20]),
            "return_token_ids": True,
        }
        if rng.random() < 0.5:
            extras["seed"] = rng.randrange(2**63)
        if rng.random() < 0.3:
            extras["logit_bias"] = {str(rng.randrange(256)): rng.choice([-50.0, 5.0])}
        if kind == 0:  # lm-evaluation-harness loglikelihood
            body = {"prompt": words, "max_tokens": 0, "echo": True, "logprobs": 1,
                    "temperature": 0}
            out.append(("/v1/completions", body))
        elif kind == 1:  # top-N logprobs with echo
            out.append(("/v1/completions", {"prompt": words, "max_tokens": 5, "echo": True,
                                            "logprobs": 3, **extras}))
        elif kind == 2:  # best_of
            out.append(("/v1/completions", {"prompt": words, "max_tokens": 4, "n": 2,
                                            "best_of": 3, **extras}))
        elif kind == 3:  # streaming, n > 1, stop string, logprobs
            out.append(("/v1/completions", {"prompt": [rng.randrange(256) for _ in range(6)],
                                            "max_tokens": 6, "n": 2, "stream": True,
                                            "stop": ["a"], "logprobs": 2, **extras}))
        elif kind == 4:  # chat with top_logprobs (a choice among strings, beside min_tokens 0)
            structured = {} if extras["min_tokens"] else {"guided_choice": ["yes", "no", "a b"]}
            out.append(("/v1/chat/completions", {
                "messages": [{"role": "user", "content": words}], "max_tokens": 5,
                "logprobs": True, "top_logprobs": 2, **structured, **extras}))
        elif kind == 5:  # streamed chat
            out.append(("/v1/chat/completions", {
                "messages": [{"role": "system", "content": "be brief"},
                             {"role": "user", "content": words}],
                "max_tokens": 6, "stream": True, **extras}))
        elif kind == 6:  # prompt_logprobs (and a JSON schema, beside min_tokens 0)
            schema = {"type": "object", "properties": {"k": {"type": "integer"}}}
            structured = {} if extras["min_tokens"] else {
                "response_format": {"type": "json_schema",
                                    "json_schema": {"name": "k", "schema": schema}}}
            out.append(("/v1/completions", {"prompt": words, "max_tokens": 8,
                                            "prompt_logprobs": 2, **structured, **extras}))
        else:  # a longer plain generation
            out.append(("/v1/completions", {"prompt": words, "max_tokens": 12, "ignore_eos": True,
                                            **extras}))
    return out


def _normalise(body: dict) -> list[dict]:
    """A response's choices without the per-response ids and times."""
    return sorted(body["choices"], key=lambda c: c["index"])


async def _call(client: httpx.AsyncClient, path: str, body: dict) -> dict:
    """The response; a stream is folded into its chunks' choices, in order."""
    if not body.get("stream"):
        response = await client.post(path, json=body)
        assert response.status_code == 200, response.text
        return {"choices": _normalise(response.json()),
                "system_fingerprint": response.json()["system_fingerprint"]}
    chunks = []
    async with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    assert chunks, "empty stream"
    assert all("error" not in c for c in chunks), chunks
    return {"choices": _fold(chunks), "system_fingerprint": chunks[0]["system_fingerprint"]}


def _fold(chunks: list[dict]) -> list[dict]:
    """A stream's choices as whole values: how the deltas fall into chunks depends on timing,
    what they add up to must not."""
    folded: dict[int, dict] = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            out = folded.setdefault(c["index"], {"text": "", "token_ids": [], "logprobs": {}})
            out["text"] += c.get("text") or (c.get("delta") or {}).get("content") or ""
            out["token_ids"] += c.get("token_ids") or []
            for key, value in (c.get("logprobs") or {}).items():
                out["logprobs"].setdefault(key, []).extend(value or [])
            for key in ("finish_reason", "stop_reason", "seed", "fingerprint"):
                if c.get(key) is not None:
                    out[key] = c[key]
    return [folded[i] for i in sorted(folded)]


def _diff(a: object, b: object, where: str = "") -> list[str]:
    """Where two JSON values differ (the assertion message)."""
    if isinstance(a, dict) and isinstance(b, dict):
        keys = sorted(set(a) | set(b))
        return [d for k in keys for d in _diff(a.get(k), b.get(k), f"{where}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        pairs = enumerate(zip(a, b, strict=True))
        return [d for i, (x, y) in pairs for d in _diff(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def _seed_of(result: dict) -> int | None:
    for choice in result["choices"]:
        for c in choice if isinstance(choice, list) else [choice]:
            if c.get("seed") is not None:
                return c["seed"]
    return None


async def _run_round(url: str, rng: random.Random) -> None:
    requests = _requests(rng)
    limits = httpx.Limits(max_connections=NUM_CLIENTS)
    async with httpx.AsyncClient(base_url=url, timeout=300.0, limits=limits) as client:
        together = await asyncio.gather(*(_call(client, p, b) for p, b in requests))
        for (path, body), result in zip(requests, together, strict=True):
            replay_body = dict(body)
            if "seed" not in body:  # the drawn seed, reported back (greedy ones too)
                replay_body["seed"] = _seed_of(result)
            alone = await _call(client, path, replay_body)
            assert alone == result, (path, body, _diff(alone, result))


def test_64_clients_mixing_every_feature_replay_identically_alone(url):
    asyncio.run(_run_round(url, random.Random(2026)))
