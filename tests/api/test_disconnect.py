"""A client that goes away mid-request has its request aborted and its KV blocks freed."""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from corun.api.server import create_app
from tests.api.client import raw_completion
from tests.api.conftest import Server
from tests.api.inprocess import BlockingTokenizer, build_engine, serve_app

pytestmark = pytest.mark.timeout(120)

LONG = {"prompt": "tell me everything", "max_tokens": 100, "ignore_eos": True, "seed": 1}


def test_disconnect_mid_stream_frees_kv(server: Server):
    """Closing a stream after two chunks aborts the request: KV usage returns to 0."""
    before = server.wait_for_idle()
    assert before["corun:kv_cache_blocks_used"] == 0
    aborted_before = before.get("corun:request_success_total[abort]", 0.0)
    with server.client() as client:
        with client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as response:
            assert response.status_code == 200
            received = 0
            for line in response.iter_lines():
                received += line.startswith("data: ")
                if received == 2:
                    # Negative control: while the stream is open its KV is held, so the check
                    # below can fail.
                    during = server.metrics()
                    break  # leaving the iterator closes the connection
    assert during["corun:kv_cache_blocks_used"] > 0
    assert during["corun:num_requests_running"] == 1
    after = server.wait_for_idle()
    assert after["corun:kv_cache_blocks_used"] == 0
    assert after["corun:num_requests_running"] == 0
    assert after["corun:request_success_total[abort]"] == aborted_before + 1


@pytest.mark.parametrize("n", [1, 3])
def test_disconnect_while_waiting_for_a_whole_response(server: Server, n: int):
    """A non-streamed request whose client goes away before its response is aborted too, and
    counted per sequence, as finished ones are (n = 3: three aborts).

    The engine is paused first (``POST /pause``), so the request waits in the engine's queue
    until the client has left and the server has noticed: it cannot finish first, whatever the
    host's speed (the server polls the connection every 0.5 s)."""
    aborted = "corun:request_success_total[abort]"
    waiting = "corun:num_requests_waiting"
    before = server.wait_for_idle()
    aborted_before = before.get(aborted, 0.0)
    with server.client() as client:
        assert client.post("/pause").json() == {"status": "paused"}
        try:
            with raw_completion(server.base_url, {**LONG, "n": n}):
                # Negative control: the request reached the engine and is held there, so the
                # abort counter below can only move because the client left.
                server.wait_for_metrics(lambda m: m[waiting] >= 1,
                                        "the request to wait in the engine")
            server.wait_for_metrics(lambda m: m.get(aborted, 0.0) > aborted_before, "the abort")
            assert server.metrics()[waiting] == 0
        finally:
            client.post("/resume")
    after = server.wait_for_idle()
    assert after[aborted] == aborted_before + n
    assert after["corun:generation_tokens_total"] == before["corun:generation_tokens_total"]
    assert after["corun:kv_cache_blocks_used"] == 0
    # And the server carries on.
    with server.client() as client:
        assert (
            client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
        )


def _aborted(client: httpx.Client) -> float:
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.labels.get("finished_reason") == "abort":
                return sample.value
    return 0.0


def test_a_stream_whose_client_left_before_it_started_is_aborted():
    """A client that goes away while its streamed request is still being prepared (tokenized,
    here held there by the tokenizer): the server submits it, and Starlette, seeing the client
    gone, never starts the stream's body. The request must still be aborted and forgotten, or it
    generates to the end for nobody and a drain waits for it until the shutdown timeout."""
    engine, tokenizer = build_engine("--max-num-seqs", "4")
    blocking = BlockingTokenizer(tokenizer)
    app = create_app(engine, blocking, model_name="corun-default", mode="corun")
    state = app.state.corun
    body = {"prompt": f"{blocking.marker} go", "max_tokens": 100, "ignore_eos": True, "seed": 1,
            "stream": True}
    with serve_app(app) as (url, server):
        with raw_completion(url, body):
            assert blocking.entered.wait(60), "the request never reached the tokenizer"
        # The server has seen the client go before the request leaves the tokenizer.
        deadline = time.monotonic() + 60
        while server.server_state.connections:
            assert time.monotonic() < deadline, "uvicorn never saw the connection close"
            time.sleep(0.01)
        blocking.release.set()
        with httpx.Client(base_url=url, timeout=60) as client:
            deadline = time.monotonic() + 60
            while _aborted(client) < 1:
                assert time.monotonic() < deadline, (
                    "the request of the client that left was never aborted")
                time.sleep(0.05)
            assert _aborted(client) == 1
            assert state._idle.is_set()  # nothing left for a drain to wait for
            # And the server carries on.
            ok = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert ok.status_code == 200, ok.text
