"""SIGTERM drains: new requests get 503 while those in flight finish; at ``--shutdown-timeout-s``
what still runs ends with an error event and ``[DONE]`` (or an error body); the exit status is 0.

Every wait is on an observable event (a chunk received, /health turning 503, a request running
in /metrics, the engine thread held inside a step), never on a sleep. The drain runs in-process,
its in-flight request held inside an engine step until the checks are done: in a subprocess the
checks raced the request's last token (had it finished first, the drained server was gone).
"""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest
import uvicorn

from experiments.serving_servers import free_port
from tests.api.conftest import launch
from tests.api.inprocess import START_TIMEOUT_S, build_engine

pytestmark = pytest.mark.timeout(180)

# Long enough to outlast the signal's handling by orders of magnitude (~10 ms a token on a CPU).
MODEL_LEN_ARGS = ("--max-model-len", "1100", "--max-num-seqs", "4")


class _Stream:
    """A streamed completion read on a thread; ``first`` is set at its first chunk."""

    def __init__(self, url: str, max_tokens: int) -> None:
        self.body = {"prompt": "tell me", "max_tokens": max_tokens, "ignore_eos": True,
                     "seed": 1, "stream": True, "return_token_ids": True}
        self.url = url
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


class _GatedEngine:
    """Delegates to ``engine``; once ``hold`` is set, the engine thread's next step waits (after
    setting ``held``) until ``release``: the test decides when the requests in flight may go on."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.hold, self.held, self.release = (threading.Event() for _ in range(3))

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def step(self):
        if self.hold.is_set() and not self.release.is_set():
            self.held.set()
            self.release.wait(START_TIMEOUT_S)
        return self.engine.step()


def test_sigterm_drains_in_flight_requests_then_exits_0():
    """The server ``corun.serve`` runs (DrainingServer over the app), in-process: after the
    signal's handler runs, /health and new requests answer 503 while the request in flight is
    held; released, it runs to its last token, the server stops, and no engine error is left
    (what makes ``corun.serve`` exit 0)."""
    from corun.api.server import create_app
    from corun.api.shutdown import DrainingServer

    engine, tokenizer = build_engine("--max-num-seqs", "4")
    gated = _GatedEngine(engine)
    app = create_app(gated, tokenizer, model_name="corun-default", mode="corun")
    port = free_port()
    server = DrainingServer(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"),
                            state=app.state.corun, shutdown_timeout_s=120)
    thread = threading.Thread(target=server.run, name="test-draining-uvicorn", daemon=True)
    thread.start()
    try:
        _wait_for(lambda: server.started or not thread.is_alive(), "the server to start")
        assert thread.is_alive(), "the server did not start"
        url = f"http://127.0.0.1:{port}"
        stream = _Stream(url, max_tokens=100)
        assert stream.first.wait(60)
        gated.hold.set()
        assert gated.held.wait(60), "the engine never stepped again"  # the stream is held
        server.handle_exit(signal.SIGTERM, None)  # what the SIGTERM handler runs
        _wait_for(lambda: httpx.get(f"{url}/health", timeout=10.0).status_code == 503,
                  "/health to report the drain")
        assert httpx.get(f"{url}/health").headers["retry-after"].isdigit()
        # Draining: a new request is refused with 503 and Retry-After, the port still answers.
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 1},
                             timeout=30.0)
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "server_shutting_down"
        assert refused.headers["retry-after"].isdigit()
        assert stream.thread.is_alive() and thread.is_alive()  # both still held by the step
        gated.release.set()
        # The stream in flight runs to its last token, then the drained server stops.
        chunks = stream.chunks()
        assert all("error" not in c for c in chunks), chunks[-1]
        assert sum(len(c["choices"][0]["token_ids"]) for c in chunks) == 100
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        thread.join(60)
        assert not thread.is_alive(), "the drained server did not stop"
        assert app.state.corun.engine_loop.error is None
    finally:
        gated.release.set()
        server.should_exit = True
        thread.join(60)


def test_sigterm_ends_what_outlasts_the_timeout_with_an_error(tmp_path):
    server = launch(tmp_path, "deadline", *MODEL_LEN_ARGS, "--shutdown-timeout-s", "0")
    try:
        stream = _Stream(server.base_url, max_tokens=1000)
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
