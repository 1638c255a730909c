"""POST /pause and /resume: the engine stops after its current step, requests in flight keep their
place and KV, new ones queue, and after /resume every request finishes with the bits it has
unpaused (corun: a request's shapes do not depend on when it runs)."""

from __future__ import annotations

import json
import threading

import pytest

from tests.api.conftest import Server

pytestmark = pytest.mark.timeout(120)

REQUEST = {"prompt": "pause me", "max_tokens": 24, "ignore_eos": True, "seed": 5,
           "temperature": 0.9}
GENERATED = "corun:generation_tokens_total"


def _stream_text(lines) -> str:
    text = ""
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            chunk = json.loads(line.removeprefix("data: "))
            text += "".join(c["text"] for c in chunk["choices"])
    return text


def test_pause_holds_a_stream_and_resume_finishes_it_with_the_same_text(server: Server):
    server.wait_for_idle()
    with server.client() as client:
        reference = client.post("/v1/completions", json=REQUEST).json()["choices"][0]
        with client.stream("POST", "/v1/completions", json={**REQUEST, "stream": True}) as resp:
            lines = resp.iter_lines()
            head = []
            for line in lines:  # two token chunks, then pause mid-generation
                head.append(line)
                if sum(x.startswith("data: ") for x in head) == 2:
                    break
            try:
                assert client.post("/pause").json() == {"status": "paused"}
                assert client.get("/is_paused").json() == {"is_paused": True}
                held = server.metrics()
                # The request keeps its slot and KV; the engine has parked, so no token is
                # generated however long we look (a second scrape after another round trip).
                assert held["corun:num_requests_running"] == 1
                assert held["corun:kv_cache_blocks_used"] > 0
                assert client.get("/v1/models").status_code == 200
                assert server.metrics()[GENERATED] == held[GENERATED]
            finally:
                assert client.post("/resume").json() == {"status": "resumed"}
            text = _stream_text(head) + _stream_text(lines)
        assert client.get("/is_paused").json() == {"is_paused": False}
    assert text == reference["text"]


def test_requests_sent_while_paused_queue_and_keep_their_bits(server: Server):
    server.wait_for_idle()
    with server.client() as client:
        reference = client.post("/v1/completions", json=REQUEST).json()["choices"][0]
        results: list[dict] = []
        assert client.post("/pause").json() == {"status": "paused"}
        try:
            worker = threading.Thread(target=lambda: results.append(
                client.post("/v1/completions", json=REQUEST).json()))
            worker.start()
            # Handed to the engine, which holds it: waiting, not running, nothing generated.
            held = server.wait_for_metrics(lambda m: m["corun:num_requests_waiting"] == 1,
                                          "the request to wait in the engine")
            assert held["corun:num_requests_running"] == 0
        finally:
            client.post("/resume")
        worker.join(60)
        assert client.get("/is_paused").json() == {"is_paused": False}
    choice = results[0]["choices"][0]
    assert choice["fingerprint"] == reference["fingerprint"]
    assert choice["text"] == reference["text"]


@pytest.mark.parametrize("option", ["wait_for_inflight_requests=true", "clear_cache=false"])
def test_pause_options_are_refused_not_ignored(server: Server, option: str):
    with server.client() as client:
        response = client.post(f"/pause?{option}")
        assert response.status_code == 400
        error = response.json()["error"]
        assert "not supported" in error["message"] and error["param"] == option.split("=")[0]
        assert client.get("/is_paused").json() == {"is_paused": False}
        assert client.post(f"/resume?{option}").status_code == 400


def test_pause_needs_the_api_key(guarded_server: Server):
    import httpx

    assert httpx.post(f"{guarded_server.base_url}/pause").status_code == 401
    with guarded_server.client() as client:
        assert client.post("/pause").json() == {"status": "paused"}
        assert client.post("/resume").json() == {"status": "resumed"}
