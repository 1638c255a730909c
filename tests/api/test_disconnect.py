"""A client that goes away mid-request has its request aborted and its KV blocks freed."""

from __future__ import annotations

import json
import socket

import pytest

from tests.api.conftest import Server

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
    body = json.dumps({**LONG, "n": n}).encode()
    host, port = server.base_url.removeprefix("http://").split(":")
    with server.client() as client:
        assert client.post("/pause").json() == {"status": "paused"}
        try:
            sock = socket.create_connection((host, int(port)), timeout=30)
            try:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                             b"Content-Type: application/json\r\n"
                             + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
                # Negative control: the request reached the engine and is held there, so the
                # abort counter below can only move because the client left.
                server.wait_for_metrics(lambda m: m[waiting] >= 1,
                                        "the request to wait in the engine")
            finally:
                sock.close()
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
