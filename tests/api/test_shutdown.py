"""SIGTERM drains: new requests get 503 while those in flight finish; at ``--shutdown-timeout-s``
what still runs ends with an error event and ``[DONE]`` (or an error body); the exit status is 0.

Real server subprocesses; every wait is on an observable event (a chunk received, /health
turning 503, a request running in /metrics), never on a sleep.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from tests.api.conftest import Server, launch

pytestmark = pytest.mark.timeout(180)

# Long enough to outlast the signal's handling by orders of magnitude (~10 ms a token on a CPU).
MODEL_LEN_ARGS = ("--max-model-len", "1100", "--max-num-seqs", "4")


class _Stream:
    """A streamed completion read on a thread; ``first`` is set at its first chunk."""

    def __init__(self, server: Server, max_tokens: int) -> None:
        self.body = {"prompt": "tell me", "max_tokens": max_tokens, "ignore_eos": True,
                     "seed": 1, "stream": True, "return_token_ids": True}
        self.url = server.base_url
        self.first = threading.Event()
        self.events: list[str] = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            with httpx.Client(base_url=self.url, timeout=120.0) as client, client.stream(
                "POST", "/v1/completions", json=self.body
            ) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[len("data: "):])
                        self.first.set()
        finally:
            self.first.set()

    def chunks(self) -> list[dict]:
        self.thread.join(120)
        assert not self.thread.is_alive()
        assert self.events and self.events[-1] == "[DONE]", self.events[-3:]
        return [json.loads(e) for e in self.events[:-1]]


def _wait_for(predicate, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _health(server: Server) -> int:
    return httpx.get(f"{server.base_url}/health", timeout=10.0).status_code


def test_sigterm_drains_in_flight_requests_then_exits_0(tmp_path):
    server = launch(tmp_path, "drain", *MODEL_LEN_ARGS, "--shutdown-timeout-s", "120")
    try:
        stream = _Stream(server, max_tokens=200)
        assert stream.first.wait(60)
        server.proc.send_signal(signal.SIGTERM)
        _wait_for(lambda: _health(server) == 503, "/health to report the drain")
        assert httpx.get(f"{server.base_url}/health").headers["retry-after"].isdigit()
        # Draining: a new request is refused with 503 and Retry-After, the port still answers.
        refused = httpx.post(f"{server.base_url}/v1/completions",
                             json={"prompt": "x", "max_tokens": 1}, timeout=30.0)
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "server_shutting_down"
        assert refused.headers["retry-after"].isdigit()
        # The stream in flight runs to its last token.
        chunks = stream.chunks()
        assert all("error" not in c for c in chunks), chunks[-1]
        assert sum(len(c["choices"][0]["token_ids"]) for c in chunks) == 200
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert server.proc.wait(timeout=60) == 0, server.log_path.read_text()[-3000:]
    finally:
        server.stop()


def test_sigterm_ends_what_outlasts_the_timeout_with_an_error(tmp_path):
    server = launch(tmp_path, "deadline", *MODEL_LEN_ARGS, "--shutdown-timeout-s", "0")
    try:
        stream = _Stream(server, max_tokens=1000)
        whole: dict = {}

        def post_whole() -> None:
            body = {"prompt": "go on", "max_tokens": 1000, "ignore_eos": True}
            whole["response"] = httpx.post(f"{server.base_url}/v1/completions", json=body,
                                           timeout=120.0)

        thread = threading.Thread(target=post_whole, daemon=True)
        thread.start()
        assert stream.first.wait(60)
        _wait_for(lambda: server.metrics()["corun:num_requests_running"] == 2,
                  "both requests to run")
        server.proc.send_signal(signal.SIGTERM)
        # The stream gets an error event, then [DONE] (not a cut connection).
        chunks = stream.chunks()
        error = chunks[-1]["error"]
        assert error["code"] == "server_shutting_down", chunks[-1]
        assert sum(len(c["choices"][0]["token_ids"]) for c in chunks[:-1]) < 1000
        # The whole-response request gets an error body.
        thread.join(60)
        response = whole["response"]
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] == "server_shutting_down"
        assert response.headers["retry-after"].isdigit()
        assert server.proc.wait(timeout=60) == 0, server.log_path.read_text()[-3000:]
    finally:
        server.stop()
