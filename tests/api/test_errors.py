"""Bad input answers 400 naming the field; 401 without the key; 503 when the queue is full.

Every case is a real HTTP request to a running server; after all of them the server still
serves a normal request.
"""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.api.conftest import MAX_MODEL_LEN, Server

pytestmark = pytest.mark.timeout(120)

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]

# (endpoint, JSON body, the field the error must name)
BAD_REQUESTS = [
    (COMPLETIONS, {"max_tokens": 4}, "prompt"),
    (CHAT, {"max_tokens": 4}, "messages"),
    (CHAT, {"messages": []}, "messages"),
    (COMPLETIONS, {"prompt": ""}, "prompt"),
    (COMPLETIONS, {"prompt": []}, "prompt"),
    (COMPLETIONS, {"prompt": 5}, "prompt"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": "16"}, "max_tokens"),
    (COMPLETIONS, {"prompt": "x", "temperature": "hot"}, "temperature"),
    (COMPLETIONS, {"prompt": "x", "n": 1.5}, "n"),
    (COMPLETIONS, {"prompt": "x", "stream": "yes"}, "stream"),
    (COMPLETIONS, {"prompt": "x", "seed": True}, "seed"),
    (COMPLETIONS, {"prompt": "x", "stop": 3}, "stop"),
    (CHAT, {"messages": "hi"}, "messages"),
    (CHAT, {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (COMPLETIONS, {"prompt": "x", "temperature": -0.5}, "temperature"),
    (COMPLETIONS, {"prompt": "x", "top_p": 0.0}, "top_p"),
    (COMPLETIONS, {"prompt": "x", "top_p": 1.5}, "top_p"),
    (COMPLETIONS, {"prompt": "x", "top_k": -2}, "top_k"),
    (COMPLETIONS, {"prompt": "x", "n": 0}, "n"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": -1}, "max_tokens"),
    (COMPLETIONS, {"prompt": "x", "seed": -(2**63) - 1}, "seed"),
    (COMPLETIONS, {"prompt": "x", "seed": 2**64}, "seed"),
    (COMPLETIONS, {"prompt": "x", "logprobs": 21}, "logprobs"),
    (COMPLETIONS, {"prompt": "x", "stop": [""]}, "stop"),
    (COMPLETIONS, {"prompt": "x", "frequency_penalty": 2.5}, "frequency_penalty"),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
    (COMPLETIONS, {"prompt": "x", "n": 3, "best_of": 2}, "best_of"),
    (COMPLETIONS, {"prompt": "x", "best_of": 2, "stream": True}, "best_of"),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {"100000": 1}}, "logit_bias"),
    (CHAT, {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
    (CHAT, {"messages": MESSAGES, "max_completion_tokens": -3}, "max_completion_tokens"),
    (COMPLETIONS, {"prompt": [1, 2, 100000]}, "prompt"),
    (COMPLETIONS, {"prompt": "a" * MAX_MODEL_LEN}, "prompt"),
    (CHAT, {"messages": [{"role": "user", "content": "a" * MAX_MODEL_LEN}]}, "messages"),
    (COMPLETIONS, {"prompt": "a" * (MAX_MODEL_LEN - 8), "max_tokens": 16}, "max_tokens"),
]


def _assert_openai_error(response: httpx.Response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    assert error["message"]
    return error


def test_bad_requests_answer_400_naming_the_field(client: httpx.Client):
    for endpoint, body, param in BAD_REQUESTS:
        response = client.post(endpoint, json=body)
        error = _assert_openai_error(response, 400, param)
        assert error["type"] == "invalid_request_error"
    # The server is unaffected: a normal request still completes.
    ok = client.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 2, "seed": 1})
    assert ok.status_code == 200 and ok.json()["choices"][0]["seed"] == 1


def test_malformed_json_and_wrong_body(client: httpx.Client):
    for raw in (b'{"prompt": "x",', b"not json", b"[1, 2]", b""):
        response = client.post(
            COMPLETIONS, content=raw, headers={"content-type": "application/json"}
        )
        assert response.status_code == 400, (raw, response.text)
        assert response.json()["error"]["type"] == "invalid_request_error"
    # Negative control: the same path with a valid body is a 200, so the 400s above are the body's.
    assert client.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 1}).status_code == 200


def test_stream_request_with_bad_field_is_a_plain_400(client: httpx.Client):
    """Validation happens before the stream opens: a bad streamed request is an HTTP 400."""
    response = client.post(COMPLETIONS, json={"prompt": "x", "stream": True, "top_p": 2})
    _assert_openai_error(response, 400, "top_p")


def test_api_key(guarded_server: Server):
    """With --api-key: 401 without the right bearer token; /health stays open."""
    url = guarded_server.base_url
    body = {"prompt": "x", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "test-key"}):
        response = httpx.post(f"{url}/v1/completions", json=body, headers=headers)
        error = _assert_openai_error(response, 401, None)
        assert error["type"] == "authentication_error"
    assert httpx.get(f"{url}/v1/models").status_code == 401
    assert httpx.get(f"{url}/health").status_code == 200
    with guarded_server.client() as client:  # sends the right key
        assert client.post("/v1/completions", json=body).status_code == 200


def test_full_queue_answers_503(guarded_server: Server):
    """A queue of one sequence: with the engine paused and one request waiting in it, the next
    request gets a 503 (queue_full, Retry-After); after /resume the waiting one finishes and the
    server takes requests again. Held on /pause and the waiting-requests gauge, not on timing."""
    guarded_server.wait_for_idle()
    body = {"prompt": "x", "max_tokens": 24, "ignore_eos": True}
    results: list[httpx.Response] = []
    with guarded_server.client() as client:
        assert client.post("/pause").json() == {"status": "paused"}
        try:
            worker = threading.Thread(
                target=lambda: results.append(client.post("/v1/completions", json=body)))
            worker.start()
            guarded_server.wait_for_metrics(lambda m: m["corun:num_requests_waiting"] == 1,
                                            "the first request to wait in the engine")
            refused = client.post("/v1/completions", json=body)
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "queue_full"
            assert refused.headers["retry-after"].isdigit()
        finally:
            assert client.post("/resume").json() == {"status": "resumed"}
        worker.join(60)
        assert results and results[0].status_code == 200, results
        assert results[0].json()["usage"]["completion_tokens"] == 24
        # The refusal did not wedge the server.
        assert client.post("/v1/completions",
                           json={"prompt": "x", "max_tokens": 1}).status_code == 200


def test_a_request_larger_than_the_queue_answers_400(guarded_server: Server):
    """Two sequences can never fit a queue of one: a 400 naming n, not a 503 to retry."""
    with guarded_server.client() as client:
        response = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "n": 2})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "n" and "--max-queue-len" in error["message"]
        assert client.post("/v1/completions",
                           json={"prompt": "x", "max_tokens": 1}).status_code == 200
        response = client.post("/v1/completions",
                               json={"prompt": "x", "max_tokens": 2, "best_of": 2})
        assert response.status_code == 400 and response.json()["error"]["param"] == "best_of"
