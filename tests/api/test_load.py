"""Bounded load test: 64 concurrent clients, 200 requests, each answered and each identical to the
same request sent alone afterwards (corun mode)."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from tests.api.conftest import Server

NUM_REQUESTS = 200
NUM_CLIENTS = 64
MAX_TOKENS = 5


def _requests(seed: int) -> list[tuple[str, dict]]:
    """(endpoint, body) per request: own seed, own prompt, a mix of completions and chat."""
    rng = random.Random(seed)
    out = []
    for i in range(NUM_REQUESTS):
        prompt = "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(1, 24)))
        common = {"max_tokens": MAX_TOKENS, "seed": rng.randrange(2**63), "temperature": 1.0}
        if i % 4 == 3:
            out.append(
                (
                    "/v1/chat/completions",
                    {"messages": [{"role": "user", "content": prompt}], **common},
                )
            )
        else:
            out.append(("/v1/completions", {"prompt": prompt, "return_token_ids": True, **common}))
    return out


def _key(endpoint: str, body: dict) -> tuple:
    """What must be identical between the loaded and the lone run of a request."""
    choice = body["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    return (
        text,
        choice.get("token_ids"),
        choice["fingerprint"],
        choice["seed"],
        choice["finish_reason"],
        body["usage"]["completion_tokens"],
    )


async def _run_loaded(server: Server, requests: list[tuple[str, dict]]) -> list[httpx.Response]:
    semaphore = asyncio.Semaphore(NUM_CLIENTS)
    limits = httpx.Limits(max_connections=NUM_CLIENTS)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=120.0, limits=limits) as client:

        async def one(endpoint: str, body: dict) -> httpx.Response:
            async with semaphore:
                return await client.post(endpoint, json=body)

        return await asyncio.gather(*(one(e, b) for e, b in requests))


@pytest.mark.timeout(240)
def test_load_every_request_answered_and_equal_to_alone(server: Server):
    """Under 64 concurrent clients every response equals the same request sent alone."""
    requests = _requests(seed=2026)
    loaded = asyncio.run(_run_loaded(server, requests))
    assert len(loaded) == NUM_REQUESTS
    assert [r.status_code for r in loaded] == [200] * NUM_REQUESTS, [
        r.text for r in loaded if r.status_code != 200
    ][:3]
    bodies = [r.json() for r in loaded]
    assert len({b["id"] for b in bodies}) == NUM_REQUESTS  # none lost, none duplicated
    for (_, request), body in zip(requests, bodies, strict=True):
        assert body["choices"][0]["seed"] == request["seed"]
    peak = server.metrics()
    assert peak["corun:kv_cache_blocks_used"] == 0  # everything finished and freed

    mismatches = []
    with server.client() as client:
        for (endpoint, request), body in zip(requests, bodies, strict=True):
            alone = client.post(endpoint, json=request)
            assert alone.status_code == 200, alone.text
            if _key(endpoint, alone.json()) != _key(endpoint, body):
                mismatches.append((request, _key(endpoint, body), _key(endpoint, alone.json())))
    assert not mismatches, f"{len(mismatches)} requests differ under load; first: {mismatches[0]}"


@pytest.mark.timeout(180)
def test_negative_control_default_mode_drifts_under_load(tmp_path_factory: pytest.TempPathFactory):
    """The same comparison catches drift: in default mode (dynamic batches, M-dependent CPU
    GEMM paths) some fingerprints under load differ from the lone run."""
    from tests.api.conftest import launch

    server = launch(
        tmp_path_factory.mktemp("serve"), "default", "--mode", "default", "--max-num-seqs", "16"
    )
    try:
        requests = [r for r in _requests(seed=7) if r[0] == "/v1/completions"][:24]
        loaded = asyncio.run(_run_loaded(server, requests))
        assert [r.status_code for r in loaded] == [200] * len(requests)
        with server.client() as client:
            alone = [client.post(e, json=b) for e, b in requests]
        differ = sum(
            _key(e, a.json()) != _key(e, b.json())
            for (e, _), a, b in zip(requests, alone, loaded, strict=True)
        )
        assert differ > 0, "default mode matched its lone runs: the comparison is insensitive"
    finally:
        server.stop()
