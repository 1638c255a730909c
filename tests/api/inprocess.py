"""An in-process server (uvicorn on a thread of the test process) over a real engine, with hooks
that a subprocess server cannot offer: an engine that fails one chosen request, a tokenizer that
blocks on an event. Used where a test must hold the server at a precise point."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn

from corun.api.server import create_app
from corun.config import EngineConfig
from corun.engine import LLMEngine
from corun.serve import build_parser, engine_config_kwargs, load_tokenizer
from experiments.serving_servers import free_port
from tests.api.conftest import COMMON_ARGS

START_TIMEOUT_S = 60.0


class InjectedFailure(RuntimeError):
    """Raised by the hooks below; never by real code."""


class _BrokenOutput:
    """A RequestOutput whose attributes raise: ``which`` = "finished" (the engine loop reads it)
    or "outputs" (the response builder reads it)."""

    def __init__(self, output: Any, which: str) -> None:
        self._output = output
        self._which = which

    def __getattr__(self, name: str) -> Any:
        if name == self._which:
            raise InjectedFailure(f"injected failure reading RequestOutput.{name}")
        return getattr(self._output, name)


@dataclass
class FaultyEngine:
    """Delegates to ``engine``; a request whose prompt ids are a key of ``faults`` fails:
    "add" in add_request, "finished" / "outputs" in its every output."""

    engine: LLMEngine
    faults: dict[tuple[int, ...], str] = field(default_factory=dict)
    # Per injected failure, how many other requests the engine held unfinished at that moment.
    others_in_flight: list[int] = field(default_factory=list)
    _broken: dict[str, str] = field(default_factory=dict)  # request id -> attribute
    _recorded: set[str] = field(default_factory=set)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def add_request(self, prompt_token_ids: list[int], params: Any, request_id: str, **kw: Any):
        fault = self.faults.get(tuple(prompt_token_ids))
        if fault == "add":
            self.others_in_flight.append(len(self.engine.requests))
            raise InjectedFailure("injected failure in add_request")
        if fault is not None:
            self._broken[request_id] = fault
        return self.engine.add_request(prompt_token_ids, params, request_id=request_id, **kw)

    def step(self) -> list:
        outputs = self.engine.step()
        out = []
        for output in outputs:
            if output.request_id in self._broken:
                if output.request_id not in self._recorded:  # its first failure
                    self._recorded.add(output.request_id)
                    others = len(set(self.engine.requests) - {output.request_id})
                    self.others_in_flight.append(others)
                output = _BrokenOutput(output, self._broken[output.request_id])
            out.append(output)
        return out


@dataclass
class BlockingTokenizer:
    """Delegates to ``tokenizer``; ``encode`` of a text holding ``marker`` sets ``entered`` and
    waits for ``release`` (a barrier the test controls)."""

    tokenizer: Any
    marker: str = "BLOCK-THE-TOKENIZER"
    entered: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.marker in text:
            self.entered.set()
            if not self.release.wait(START_TIMEOUT_S):
                raise InjectedFailure("the test never released the tokenizer")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)


def build_engine(*flags: str) -> tuple[LLMEngine, Any]:
    """The engine and tokenizer ``python -m corun.serve`` builds from these flags (CPU)."""
    args = build_parser().parse_args([*COMMON_ARGS, "--device", "cpu", *flags])
    tokenizer = load_tokenizer(args.model)
    return LLMEngine(EngineConfig(**engine_config_kwargs(args)), tokenizer), tokenizer


@contextmanager
def serve_in_thread(engine: Any, tokenizer: Any, **app_kwargs: Any) -> Iterator[str]:
    """The app over ``engine`` served on a free loopback port; yields its base URL. Stopping it
    closes the engine (the app owns it)."""
    app = create_app(engine, tokenizer, model_name="corun-default", mode="corun", **app_kwargs)
    with serve_app(app) as (url, _):
        yield url


@contextmanager
def serve_app(app: Any) -> Iterator[tuple[str, uvicorn.Server]]:
    """``app`` served on a free loopback port; yields its base URL and the uvicorn server (its
    ``server_state.connections`` are the open connections)."""
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the in-process server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.should_exit = True
        thread.join(START_TIMEOUT_S)
