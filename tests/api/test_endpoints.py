"""Endpoints and HTTP semantics: /v1/models/{id}, /version, 404 for an unknown model, 405 with
``Allow``, 413 for a body over the limit, 503 with ``Retry-After``, and the queue limit counted in
sequences (prompts x n), checked before anything is queued."""

from __future__ import annotations

import httpx
import pytest

from corun.api.server import DEFAULT_MAX_REQUEST_BODY_BYTES
from tests.api.conftest import GUARDED_NAME, Server

pytestmark = pytest.mark.timeout(120)


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_model_by_id_and_version(client: httpx.Client):
    card = client.get("/v1/models/corun-default")
    assert card.status_code == 200
    assert card.json() | {"created": 0} == client.get("/v1/models").json()["data"][0] | {
        "created": 0
    }
    error = _error(client.get("/v1/models/no-such-model"), 404)
    assert (error["param"], error["code"]) == ("model", "model_not_found")
    # Names with slashes, as HF ids have, reach the handler too.
    assert _error(client.get("/v1/models/Qwen/Qwen3-8B"), 404)["code"] == "model_not_found"
    version = client.get("/version")
    assert version.status_code == 200 and version.json()["version"]


def test_unknown_model_is_404_everywhere(client: httpx.Client):
    bodies = [
        ("/v1/completions", {"prompt": "x", "model": "gpt-4"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "model": "x"}),
        ("/tokenize", {"prompt": "x", "model": "x"}),
        ("/detokenize", {"tokens": [1], "model": "x"}),
    ]
    for endpoint, body in bodies:
        error = _error(client.post(endpoint, json=body), 404)
        assert (error["param"], error["code"]) == ("model", "model_not_found"), endpoint
    # Negative control: the served name is served.
    ok = client.post("/v1/completions", json={"prompt": "x", "model": "corun-default",
                                              "max_tokens": 1})
    assert ok.status_code == 200


def test_served_name_and_root_are_both_accepted(guarded_server: Server):
    """vLLM's rule: the served model name, or the model it stands for."""
    with guarded_server.client() as client:
        assert client.get("/v1/models").json()["data"][0]["root"] == "corun-default"
        for name in (GUARDED_NAME, "corun-default"):
            body = {"prompt": "x", "max_tokens": 1, "model": name}
            assert client.post("/v1/completions", json=body).status_code == 200, name
            assert client.get(f"/v1/models/{name}").status_code == 200
        body = {"prompt": "x", "max_tokens": 1, "model": "other"}
        _error(client.post("/v1/completions", json=body), 404)


def test_wrong_method_is_405_with_allow(client: httpx.Client):
    for method, path, allowed in (("GET", "/v1/completions", "POST"),
                                  ("DELETE", "/v1/chat/completions", "POST"),
                                  ("POST", "/health", "GET"), ("PUT", "/v1/models", "GET")):
        response = client.request(method, path)
        _error(response, 405)
        assert response.headers["allow"] == allowed, (method, path)


def test_body_over_the_limit_is_413(client: httpx.Client):
    over = DEFAULT_MAX_REQUEST_BODY_BYTES + 1
    body = b'{"prompt": "' + b"a" * (over - len(b'{"prompt": ""}')) + b'"}'
    assert len(body) == over
    headers = {"content-type": "application/json"}
    error = _error(client.post("/v1/completions", content=body, headers=headers), 413)
    assert error["code"] == "request_too_large"

    def chunks():  # no Content-Length: counted as it arrives
        for start in range(0, len(body), 1 << 20):
            yield body[start : start + (1 << 20)]

    error = _error(client.post("/v1/completions", content=chunks(), headers=headers), 413)
    assert error["code"] == "request_too_large"
    # Negative control: a large body under the limit reaches validation (400 for its length).
    under = b'{"prompt": "' + b"a" * (1 << 20) + b'"}'
    _error(client.post("/v1/completions", content=under, headers=headers), 400)
    assert client.get("/health").status_code == 200


def test_queue_limit_counts_sequences(guarded_server: Server):
    """A queue of one sequence: one prompt with n = 2 (or two prompts) can never be queued, so it
    is refused whole with a 400 naming what made it too large, before any of it is queued (a 503
    would invite a retry that cannot succeed); n = 1 is served."""
    with guarded_server.client() as client:
        before = guarded_server.metrics()
        for body, field in (({"prompt": "x", "n": 2}, "n"), ({"prompt": ["x", "y"]}, "prompt"),
                            ({"prompt": "x", "n": 128}, "n")):
            response = client.post("/v1/completions", json={**body, "max_tokens": 4})
            error = _error(response, 400)
            assert error["param"] == field and "--max-queue-len" in error["message"], error
        after = guarded_server.metrics()
        assert after["corun:prompt_tokens_total"] == before["corun:prompt_tokens_total"]
        assert after.get("corun:request_success_total[abort]", 0.0) == before.get(
            "corun:request_success_total[abort]", 0.0
        )
        ok = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert ok.status_code == 200


def test_prefix_cache_counters_count_a_repeated_prompt(server: Server):
    """The second of two identical 100-token prompts hits the cache (corun on the CPU: hits at
    multiples of lcm(16, C = 64) = 64 tokens) and returns the first one's choice bit for bit."""
    body = {"prompt": "p" * 100, "max_tokens": 3, "seed": 11, "temperature": 0.7}
    with server.client() as client:
        before = server.metrics()
        first = client.post("/v1/completions", json=body).json()["choices"][0]
        middle = server.metrics()
        second = client.post("/v1/completions", json=body).json()["choices"][0]
        after = server.metrics()
    # At least: the session's server may still be admitting another test's leftovers.
    queries, hits = "corun:prefix_cache_queries_total", "corun:prefix_cache_hits_total"
    assert middle[queries] - before[queries] >= 100 and after[queries] - middle[queries] >= 100
    assert after[hits] - middle[hits] >= 64
    assert (second["text"], second["fingerprint"]) == (first["text"], first["fingerprint"])


def test_engine_step_metrics_count_a_request_s_prefill_and_decode_steps(server: Server):
    """/metrics counts the engine's steps by kind, their wall times and the tokens each
    scheduled: one request of P prompt tokens and 6 output tokens adds at least one prefill
    step, 5 decode steps and P + 5 scheduled tokens (at least: the session's server may still
    run another test's leftovers). A step that sampled is observed before its outputs are
    routed (corun.step_timing), so the response's arrival orders the scrape after every step
    of it."""
    body = {"prompt": "metrics " * 5, "max_tokens": 6, "ignore_eos": True, "seed": 5}
    with server.client() as client:
        before = server.metrics()
        response = client.post("/v1/completions", json=body).json()
        after = server.metrics()
    prompt_tokens = response["usage"]["prompt_tokens"]
    assert response["usage"]["completion_tokens"] == 6

    def delta(name: str) -> float:
        return after[name] - before[name]

    assert delta("corun:engine_steps_total[prefill]") + delta(
        "corun:engine_steps_total[combined]") >= 1
    assert delta("corun:engine_steps_total[decode]") + delta(
        "corun:engine_steps_total[combined]") >= 5
    for kind in ("prefill", "decode", "combined"):  # one wall time per step
        assert delta(f"corun:engine_step_seconds_count[{kind}]") == delta(
            f"corun:engine_steps_total[{kind}]")
    # every step takes time: five decode steps at least add a positive sum
    assert delta("corun:engine_step_seconds_sum[decode]") + delta(
        "corun:engine_step_seconds_sum[combined]") > 0
    assert delta("corun:engine_step_tokens_sum") >= prompt_tokens + 5
    assert delta("corun:engine_step_tokens_count") == sum(
        delta(f"corun:engine_steps_total[{kind}]") for kind in ("prefill", "decode", "combined"))
