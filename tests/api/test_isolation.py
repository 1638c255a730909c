"""One request's failure fails that request only; one request's CPU work stalls no other.

An in-process server (``tests.api.inprocess``) over a real engine whose hooks fail chosen requests
(in ``add_request``, or in each of their outputs) and block tokenization on an event: every wait
below is on an observable event (a chunk received, the tokenizer entered), never on a sleep.
"""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

from tests.api.inprocess import BlockingTokenizer, FaultyEngine, build_engine, serve_in_thread

pytestmark = pytest.mark.timeout(180)

FAIL_ADD = (70, 65, 73, 76)  # add_request raises
FAIL_ROUTE = (66, 82, 75, 49)  # every output raises in the engine loop (RequestOutput.finished)
FAIL_BUILD = (66, 82, 75, 50)  # every output raises in the response builder (.outputs)
MAX_TOKENS = 24
# The healthy streams run this long so that they are in flight when the failures happen (the
# engine hook records it; the test checks it rather than assume it).
LONG_TOKENS = 100


@pytest.fixture(scope="module")
def hooks():
    engine, tokenizer = build_engine("--max-num-seqs", "8")
    faulty = FaultyEngine(
        engine, {FAIL_ADD: "add", FAIL_ROUTE: "finished", FAIL_BUILD: "outputs"}
    )
    blocking = BlockingTokenizer(tokenizer)
    with serve_in_thread(faulty, blocking) as url:
        yield url, faulty, blocking


def _body(prompt, seed: int, stream: bool, max_tokens: int = MAX_TOKENS) -> dict:
    return {"prompt": list(prompt), "max_tokens": max_tokens, "ignore_eos": True, "seed": seed,
            "stream": stream, "return_token_ids": True}


class _Stream:
    """A streamed completion read on its own thread; ``first`` is set at the first chunk."""

    def __init__(self, url: str, body: dict) -> None:
        self.url, self.body = url, body
        self.first = threading.Event()
        self.events: list[str] = []
        self.status: int | None = None
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            with httpx.Client(base_url=self.url, timeout=120.0) as client, client.stream(
                "POST", "/v1/completions", json=self.body
            ) as response:
                self.status = response.status_code
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[len("data: "):])
                        self.first.set()
        finally:
            self.first.set()

    def result(self) -> tuple[list[dict], bool]:
        """The JSON events and whether [DONE] ended the stream."""
        self.thread.join(120)
        assert not self.thread.is_alive()
        done = bool(self.events) and self.events[-1] == "[DONE]"
        return [json.loads(e) for e in self.events if e != "[DONE]"], done


def _token_ids(chunks: list[dict]) -> list[int]:
    return [t for c in chunks for choice in c["choices"] for t in choice["token_ids"]]


async def _replay_alone(url: str, bodies: list[dict]) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=120.0) as client:
        responses = await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))
    return [r.json() for r in responses]


def test_a_failing_request_fails_alone_while_others_stream(hooks):
    """Failures injected into one request (while adding it, while routing its outputs, while
    building its response) answer that request with an error; the streams in flight beside it
    run to their last token, and equal the same requests replayed without the failures."""
    url, faulty, _ = hooks
    faulty.others_in_flight.clear()
    streams = [
        _Stream(url, _body([101 + i, 7, 9], seed=i, stream=True, max_tokens=LONG_TOKENS))
        for i in range(3)
    ]
    for s in streams:
        assert s.first.wait(60), "a stream never produced its first chunk"
    with httpx.Client(base_url=url, timeout=120.0) as client:
        failed = client.post("/v1/completions", json=_body(FAIL_ADD, 1, stream=False))
        assert failed.status_code == 500, failed.text
        assert "injected failure in add_request" in failed.json()["error"]["message"]
        for prompt in (FAIL_ROUTE, FAIL_BUILD):  # one at a time: each sees only the streams
            victim = _Stream(url, _body(prompt, 2, stream=True))
            chunks, done = victim.result()
            assert victim.status == 200 and done, victim.events
            assert "error" in chunks[-1], chunks[-1]
            assert "injected failure" in chunks[-1]["error"]["message"]
        # Each failure happened while the three streams were in the engine.
        assert faulty.others_in_flight == [3, 3, 3], faulty.others_in_flight
        results = [s.result() for s in streams]
        for s, (chunks, done) in zip(streams, results, strict=True):
            assert done and all("error" not in c for c in chunks), s.events
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
            assert len(_token_ids(chunks)) == LONG_TOKENS
        alone = asyncio.run(_replay_alone(url, [{**s.body, "stream": False} for s in streams]))
        for (chunks, _), body in zip(results, alone, strict=True):
            assert body["choices"][0]["token_ids"] == _token_ids(chunks)
        # The engine thread is alive and serves on.
        assert client.get("/health").status_code == 200
        ok = client.post("/v1/completions", json=_body([5, 6], 3, stream=False))
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == MAX_TOKENS


def test_health_and_streams_run_while_a_request_is_tokenized(hooks):
    """While one request's tokenization is held on a barrier, /health answers and a stream
    started after it runs to [DONE]: request preprocessing is off the event loop."""
    url, _, tokenizer = hooks
    tokenizer.entered.clear()
    tokenizer.release.clear()
    held: dict = {}

    def post_blocked() -> None:
        with httpx.Client(base_url=url, timeout=120.0) as client:
            held["response"] = client.post(
                "/v1/completions", json={"prompt": f"x {tokenizer.marker} y", "max_tokens": 2}
            )

    thread = threading.Thread(target=post_blocked, daemon=True)
    thread.start()
    try:
        assert tokenizer.entered.wait(60), "the request never reached the tokenizer"
        # The tokenizer is blocked now. Were it on the event loop, nothing below could finish.
        assert httpx.get(f"{url}/health", timeout=30.0).status_code == 200
        stream = _Stream(url, _body([33, 34], seed=5, stream=True))
        chunks, done = stream.result()
        assert done and len(_token_ids(chunks)) == MAX_TOKENS
        assert thread.is_alive()  # the blocked request is still blocked: the barrier held
    finally:
        tokenizer.release.set()
    thread.join(60)
    assert held["response"].status_code == 200, held["response"].text
