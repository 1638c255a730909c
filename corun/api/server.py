"""The OpenAI-compatible HTTP server (FastAPI) over one ``LLMEngine`` running on its own thread.

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (``stream: true`` sends
server-sent events ending in ``data: [DONE]``), ``GET /v1/models``, ``GET /v1/models/{id}``,
``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info``, ``GET /health``,
``GET /version``, ``GET /metrics`` (Prometheus text).

Every request is validated completely before it reaches the engine (``corun.api.preprocess``:
the pydantic models, then the model name, the prompt's ids and length, and ``SamplingParams``): a
bad one is answered 400 with an OpenAI-style body naming the field and never disturbs the
requests in flight. That work (JSON parsing, tokenization, chat templates) runs on worker threads,
so a large request never stalls ``/health`` or the open streams. 401 without the right
``Authorization: Bearer`` when an API key is set, 404 for an unknown model, 413 for a body over
the limit, 503 (with ``Retry-After``) when the queue is full or the server is shutting down.

Shutdown (``drain``): new requests get 503 while the requests in flight finish, up to a timeout;
whatever still runs then ends with an error (an SSE error event and ``data: [DONE]``, or an error
body).

Each choice carries ``seed`` (the drawn one when the request gave none) and ``fingerprint``: in
``corun`` and ``batch_invariant`` modes, replaying the request with that seed gives the same
tokens and the same fingerprint whatever else the server is doing. ``system_fingerprint`` names
the mode. A client that disconnects has its requests aborted and their KV blocks freed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from corun.api import preprocess, responses
from corun.api.engine_loop import EngineDeadError, EngineError, EngineLoop, QueueFullError
from corun.api.errors import APIError, install_error_handlers
from corun.api.metrics import CONTENT_TYPE, ServerMetrics
from corun.api.middleware import BearerAuth, BodySizeLimit, RetryAfter
from corun.api.preprocess import Submission
from corun.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from corun.api.response_models import (
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
    VersionResponse,
)
from corun.api.streaming import SSE_DONE, ChoiceState, sse
from corun.api.weights import add_weight_routes
from corun.sampling_params import SamplingParams

logger = logging.getLogger("corun.serve")

# How often a waiting handler checks whether its client is still connected.
DISCONNECT_POLL_S = 0.5
# vLLM has no body limit; 16 MiB holds a batch of long token-id prompts and bounds what one request
# can make the server parse.
DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 1024 * 1024
# Worker threads for request preprocessing (parsing, tokenization, chat templates).
NUM_PREPROCESS_WORKERS = 4
# After the drain deadline, how long the ended requests get to send their last bytes.
END_GRACE_S = 5.0
# Put on a request's queue when the drain deadline ends it.
SHUTDOWN = object()

T = TypeVar("T")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("corun")
    except PackageNotFoundError:
        return "0+unknown"


@dataclass
class ServerState:
    engine_loop: EngineLoop
    tokenizer: Any
    model_name: str
    model_root: str
    max_model_len: int
    vocab_size: int
    mode: str
    validate: Callable[[list[int], SamplingParams], list[int]]
    metrics: ServerMetrics
    api_key: str | None = None
    # Sampling defaults for fields a request leaves out (the model's generation_config.json,
    # as vLLM applies it; SamplingParams names).
    default_sampling: dict[str, Any] = field(default_factory=dict)
    # Output tokens at most for every request (vLLM's --generation-config FOLDER).
    max_tokens_ceiling: int | None = None
    executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(
            NUM_PREPROCESS_WORKERS, thread_name_prefix="corun-preprocess"
        )
    )
    draining: bool = False
    # The response queues of the requests in the engine (each ends by untrack).
    _active: set[asyncio.Queue] = field(default_factory=set)
    _idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self._idle.set()

    @property
    def system_fingerprint(self) -> str:
        """The engine's (``corun.system_fingerprint``): equal exactly when comparable."""
        return self.engine_loop.system_fingerprint

    @property
    def model_names(self) -> frozenset[str]:
        return frozenset((self.model_name, self.model_root))

    def model_card(self) -> ModelCard:
        return ModelCard(id=self.model_name, root=self.model_root, max_model_len=self.max_model_len)

    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a preprocessing thread: the event loop keeps serving meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    # -- shutdown ---------------------------------------------------------------------------------

    def check_accepting(self) -> None:
        if self.draining:
            raise APIError(
                503, "The server is shutting down; retry on another replica or later.", None,
                code="server_shutting_down",
            )

    def track(self, queue: asyncio.Queue) -> None:
        self._active.add(queue)
        self._idle.clear()

    def untrack(self, queue: asyncio.Queue) -> None:
        self._active.discard(queue)
        if not self._active:
            self._idle.set()

    async def drain(self, timeout_s: float) -> None:
        """Refuse new requests, let those in flight finish for up to ``timeout_s``, then end the
        rest with an error (their clients get it, their engine requests are aborted). A paused
        engine is resumed: those in flight can only finish if it steps."""
        self.draining = True
        self.engine_loop.resume()
        logger.info("draining: %d request(s) in flight, up to %.1f s", len(self._active), timeout_s)
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return
        except asyncio.TimeoutError:
            pass
        logger.warning("shutdown timeout: ending %d request(s) still in flight", len(self._active))
        for queue in list(self._active):
            queue.put_nowait((None, SHUTDOWN))
        try:  # a client that stopped reading cannot be waited for
            await asyncio.wait_for(self._idle.wait(), END_GRACE_S)
        except asyncio.TimeoutError:
            pass


def create_app(
    engine: Any,
    tokenizer: Any,
    *,
    model_name: str,
    mode: str,
    model_root: str | None = None,
    api_key: str | None = None,
    max_queue_len: int | None = None,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
    on_engine_failure: Callable[[BaseException], None] | None = None,
    default_sampling: dict[str, Any] | None = None,
    max_tokens_ceiling: int | None = None,
) -> FastAPI:
    """The FastAPI app over ``engine`` (an ``LLMEngine``, owned by the app's engine thread).

    The app owns the engine: its shutdown stops the engine thread, then closes the engine
    (worker processes of tensor parallelism included). ``model_root``: the model the name stands
    for (``--model``; requests may name either). ``max_queue_len``: waiting sequences at most.
    ``on_engine_failure(exc)`` runs on the engine thread if the engine dies.
    ``default_sampling``: what a request that leaves a field out samples with
    (``corun.sampling_params.generation_config_defaults``); its ``max_tokens`` only when the
    request leaves max_tokens out (vLLM's ``--generation-config auto``).
    ``max_tokens_ceiling``: output tokens at most for every request (vLLM's
    ``--generation-config FOLDER`` with max_new_tokens).
    """
    metrics = ServerMetrics(model_name)
    state = ServerState(
        engine_loop=EngineLoop(engine, metrics, max_queue_len, on_failure=on_engine_failure),
        tokenizer=tokenizer,
        model_name=model_name,
        model_root=model_root or model_name,
        max_model_len=engine.config.max_model_len,
        vocab_size=engine.vocab_size,
        mode=str(mode),
        validate=engine.validate,
        metrics=metrics,
        api_key=api_key,
        default_sampling=dict(default_sampling or {}),
        max_tokens_ceiling=max_tokens_ceiling,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.engine_loop.start()
        yield
        state.engine_loop.stop()
        state.executor.shutdown(wait=False, cancel_futures=True)
        close = getattr(engine, "close", None)
        if close is not None:
            close()

    app = FastAPI(title="CoRun", lifespan=lifespan)
    app.state.corun = state
    install_error_handlers(app, metrics.observe_error)
    # Added innermost first: RetryAfter sees every response, the limit applies before the key.
    if api_key is not None:
        app.add_middleware(BearerAuth, api_key=api_key, observe_error=metrics.observe_error)
    app.add_middleware(
        BodySizeLimit, max_bytes=max_request_body_bytes, observe_error=metrics.observe_error
    )
    app.add_middleware(RetryAfter)

    @app.get("/health")
    async def health() -> Response:
        ok = state.engine_loop.is_alive and not state.draining
        return Response(status_code=200 if ok else 503)

    @app.get("/ping")
    @app.post("/ping")
    async def ping() -> Response:
        return await health()

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version() -> VersionResponse:
        return VersionResponse(version=_version())

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[state.model_card()])

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> ModelCard:
        preprocess.check_model(state, model_id)
        return state.model_card()

    @app.post("/pause")
    async def pause(raw: Request) -> JSONResponse:
        """Stop generating after the current step (RL weight syncs, as vLLM's ``/pause``): requests
        in flight keep their place and finish after ``/resume``; new ones queue."""
        _refuse_query_params(raw)
        try:
            await state.run_blocking(state.engine_loop.pause)
        except EngineDeadError as exc:
            raise APIError(503, str(exc), None, code="engine_dead") from exc
        return JSONResponse({"status": "paused"})

    @app.post("/resume")
    async def resume(raw: Request) -> JSONResponse:
        _refuse_query_params(raw)
        state.engine_loop.resume()
        return JSONResponse({"status": "resumed"})

    add_weight_routes(app, state)

    @app.get("/is_paused")
    async def is_paused() -> JSONResponse:
        return JSONResponse({"is_paused": state.engine_loop.is_paused})

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> JSONResponse:
        return JSONResponse(state.tokenizer.info(model_max_length=state.max_model_len))

    @app.post("/tokenize")
    @app.post("/v1/tokenize")
    async def tokenize(raw: Request) -> TokenizeResponse:
        return await state.run_blocking(_tokenize, state, await raw.body())

    @app.post("/detokenize")
    @app.post("/v1/detokenize")
    async def detokenize(raw: Request) -> DetokenizeResponse:
        return await state.run_blocking(_detokenize, state, await raw.body())

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        state.check_accepting()
        body, subs, echo = await state.run_blocking(_prepare_completion, state, await raw.body())
        build = responses.CompletionBuilder(state, body, subs, echo)
        return await _respond(state, raw, subs, build, body.stream)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Response:
        state.check_accepting()
        body, subs = await state.run_blocking(_prepare_chat, state, await raw.body())
        build = responses.ChatBuilder(state, body, subs)
        return await _respond(state, raw, subs, build, body.stream)

    return app


def _refuse_query_params(raw: Request) -> None:
    """``/pause`` and ``/resume`` take no options: vLLM's ``wait_for_inflight_requests`` and
    ``clear_cache`` are not implemented, so they are refused, not ignored."""
    for name in raw.query_params:
        raise APIError(400, f"{name}: not supported by /pause and /resume (in-flight requests "
                       "are kept and resume where they stopped)", name)


# -- preprocessing, on a worker thread -------------------------------------------------------------


def _tokenize(state: ServerState, raw: bytes) -> TokenizeResponse:
    body = preprocess.parse(TokenizeRequest, raw)
    preprocess.check_model(state, body.model)
    if body.messages is not None:
        text = preprocess.render_chat(
            state,
            body.messages,
            body.add_generation_prompt,
            body.continue_final_message,
            body.chat_template_kwargs,
        )
    else:
        text = body.prompt
    ids = state.tokenizer.encode(text, add_special_tokens=body.adds_special_tokens)
    strs = [state.tokenizer.id_to_token(t) for t in ids] if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=state.max_model_len, tokens=ids,
                            token_strs=strs)


def _detokenize(state: ServerState, raw: bytes) -> DetokenizeResponse:
    body = preprocess.parse(DetokenizeRequest, raw)
    preprocess.check_model(state, body.model)
    bad = [t for t in body.tokens if not 0 <= t < state.vocab_size]
    if bad:
        raise APIError(400, f"tokens: {bad[0]} is outside [0, {state.vocab_size})", "tokens")
    return DetokenizeResponse(prompt=state.tokenizer.decode(body.tokens,
                                                            skip_special_tokens=False))


def _prepare_completion(
    state: ServerState, raw: bytes
) -> tuple[CompletionRequest, list[Submission], list[str]]:
    body = preprocess.parse(CompletionRequest, raw)
    subs, echo = preprocess.completion_submissions(state, body)
    return body, subs, echo


def _prepare_chat(state: ServerState, raw: bytes) -> tuple[ChatCompletionRequest, list[Submission]]:
    body = preprocess.parse(ChatCompletionRequest, raw)
    return body, preprocess.chat_submissions(state, body)


# -- serving, on the event loop --------------------------------------------------------------------


async def _respond(
    state: ServerState,
    raw: Request,
    subs: list[Submission],
    build: Any,
    stream: bool,
) -> Response:
    """Submit every prompt (all or none), then answer with one JSON body or an SSE stream."""
    state.check_accepting()
    limit = state.engine_loop.max_queue_len
    num_seqs = sum(s.params.num_samples for s in subs)
    if limit is not None and num_seqs > limit:  # no retry can queue it: the client's error
        field = ("best_of" if any(s.params.num_samples > s.params.n for s in subs)
                 else "n" if any(s.params.n > 1 for s in subs) else "prompt")
        raise APIError(400, f"{field}: this request's {num_seqs} sequences (prompts x n, or "
                       f"best_of) exceed the server's queue of {limit} (--max-queue-len)", field)
    queue: asyncio.Queue = asyncio.Queue()
    # A whole response needs only the finished outputs (vLLM's FINAL_ONLY): the engine builds
    # and hands over nothing for it on the steps before.
    build.final_only = not stream
    try:
        state.engine_loop.submit([(s.request_id, s.prompt_ids, s.params) for s in subs], queue,
                                 final_only=not stream)
    except QueueFullError as exc:
        raise APIError(503, str(exc), None, code="queue_full") from None
    except EngineDeadError as exc:
        raise APIError(503, str(exc), None, code="engine_dead") from None
    state.track(queue)
    events = _events(state, raw, subs, build, queue)
    if stream:
        return StreamingResponse(_sse_stream(build, events), media_type="text/event-stream")
    async for _ in events:
        pass
    return JSONResponse(build.final().model_dump())


async def _events(
    state: ServerState,
    raw: Request,
    subs: list[Submission],
    build: Any,
    queue: asyncio.Queue,
) -> AsyncIterator[list[ChoiceState]]:
    """Fold engine outputs into ``build``; yields the choices each output changed.

    Aborts every unfinished engine request when it exits early: the client went away (polled
    every DISCONNECT_POLL_S), the stream was cancelled, an engine error ended the request, or the
    shutdown deadline did.
    """
    by_id = {sub.request_id: sub for sub in subs}
    unfinished = set(by_id)
    try:
        next_check = time.monotonic() + DISCONNECT_POLL_S
        while unfinished:
            try:
                request_id, item = await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                item = None
            # Checked by the clock, not only on a timeout: outputs may arrive every few ms.
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + DISCONNECT_POLL_S
                if await raw.is_disconnected():
                    logger.info("client disconnected; aborting %d request(s)", len(unfinished))
                    return
            if item is None:
                continue
            if item is SHUTDOWN:
                raise APIError(
                    503,
                    "The server is shutting down and the request did not finish before the "
                    "shutdown timeout.",
                    None,
                    code="server_shutting_down",
                )
            if isinstance(item, EngineError):
                raise APIError(item.status, item.message, None)
            changed = build.update(by_id[request_id], item)
            if item.finished:
                unfinished.discard(request_id)
            yield changed
    finally:
        for request_id in unfinished:
            state.engine_loop.abort(request_id)
        if unfinished:
            # Sequences, the unit every finish reason counts (an n = 3 request finishes 3).
            state.metrics.observe_aborted(build.num_unfinished(by_id[r] for r in unfinished))
        state.untrack(queue)


async def _sse_stream(build: Any, events: AsyncIterator[list[ChoiceState]]) -> AsyncIterator[str]:
    """SSE frames: one chunk per changed choice, the usage chunk if asked, then [DONE].

    An error after the stream started cannot change the status any more: it is sent as a
    ``data: {"error": ...}`` event, then [DONE], as vLLM does; so is a failure of this request's
    own response building (the other requests never see it).
    """
    try:
        async for changed in events:
            for chunk in build.chunks(changed):
                yield sse(chunk)
        usage = build.usage_chunk()
        if usage is not None:
            yield sse(usage)
    except APIError as exc:
        build.state.metrics.observe_error(exc.status)
        yield sse(exc.body())
    except Exception as exc:  # noqa: BLE001 - fail this stream only, and say so
        logger.exception("stream failed")
        build.state.metrics.observe_error(500)
        yield sse(APIError(500, f"internal error: {exc!r}", None).body())
    finally:
        await events.aclose()
    yield SSE_DONE
