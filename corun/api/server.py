"""The OpenAI-compatible HTTP server (FastAPI) over one ``LLMEngine`` running on its own thread.

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (``stream: true`` sends
server-sent events ending in ``data: [DONE]``), ``GET /v1/models``, ``POST /tokenize``,
``POST /detokenize``, ``GET /health``, ``GET /metrics`` (Prometheus text).

Every request is validated completely before it reaches the engine (pydantic models, then the
model name, the prompt's ids and length, and ``SamplingParams``): a bad one is answered 400 with an
OpenAI-style body ``{"error": {"message", "type", "param", "code"}}`` naming the field and never
disturbs the requests in flight. 401 without the right ``Authorization: Bearer`` when an API key
is set (``/health`` and ``/metrics`` are exempt), 503 when ``max_queue_len`` requests wait.

Each choice carries ``seed`` (the drawn one when the request gave none) and ``fingerprint``: in
``corun`` and ``batch_invariant`` modes, replaying the request with that seed gives the same
tokens and the same fingerprint whatever else the server is doing. ``system_fingerprint`` names
the mode. A client that disconnects has its requests aborted and their KV blocks freed.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from corun.api import responses
from corun.api.engine_loop import EngineDeadError, EngineError, EngineLoop, QueueFullError
from corun.api.metrics import CONTENT_TYPE, ServerMetrics
from corun.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    random_id,
)
from corun.api.streaming import SSE_DONE, ChoiceState, sse
from corun.sampling_params import SamplingParams

logger = logging.getLogger("corun.serve")

# How often a waiting handler checks whether its client is still connected.
DISCONNECT_POLL_S = 0.5
AUTH_EXEMPT_PATHS = ("/health", "/ping", "/metrics", "/version")


class APIError(Exception):
    """An error answered with an OpenAI-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = (
            status,
            message,
            param,
            type,
            code,
        )

    def body(self) -> dict:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()


def _param_of(message: str, default: str | None) -> str | None:
    """The engine's ValueErrors start with the field they name (``"top_p: expected ..."``)."""
    head, sep, _ = message.partition(":")
    return head.strip() if sep and head.strip().isidentifier() else default


@dataclass
class Submission:
    """One engine request of an HTTP request: prompt ``prompt_index`` with its own params."""

    request_id: str
    prompt_index: int
    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class ServerState:
    engine_loop: EngineLoop
    tokenizer: Any
    model_name: str
    max_model_len: int
    vocab_size: int
    mode: str
    validate: Callable[[list[int], SamplingParams], list[int]]
    metrics: ServerMetrics
    api_key: str | None = None

    @property
    def system_fingerprint(self) -> str:
        return f"corun-{self.mode}"

    # -- validation -----------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                400,
                f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                "model",
                code="model_not_found",
            )

    def encode(self, prompt: str | list[int], field: str) -> list[int]:
        if isinstance(prompt, list):
            return list(prompt)
        if not prompt:
            raise APIError(400, f"{field}: expected a non-empty prompt", field)
        return self.tokenizer.encode(prompt)

    def sampling_params(
        self,
        body: Any,
        prompt_ids: list[int],
        max_tokens: int | None,
        logprobs: int | None,
        field: str,
    ) -> SamplingParams:
        """SamplingParams for one prompt; ValueErrors become 400s naming the field."""
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens; the "
                f"prompt has {len(prompt_ids)}, which leaves no room to generate.",
                field,
            )
        if max_tokens is None:
            max_tokens = room
        elif max_tokens > room:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {len(prompt_ids) + max_tokens} tokens "
                f"({len(prompt_ids)} in the {field}, {max_tokens} in the completion).",
                "max_tokens",
            )
        try:
            params = SamplingParams(
                n=body.n,
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=body.top_k,
                max_tokens=max_tokens,
                seed=body.seed,
                stop=body.stop_list or None,
                stop_token_ids=body.stop_token_ids,
                include_stop_str_in_output=body.include_stop_str_in_output,
                ignore_eos=body.ignore_eos,
                logprobs=logprobs,
            )
            self.validate(prompt_ids, params)
        except ValueError as exc:
            param = _param_of(str(exc), field)
            param = field if param in ("prompt", "prompt_token_ids") else param
            raise APIError(400, str(exc), param) from None
        return params


def create_app(
    engine: Any,
    tokenizer: Any,
    *,
    model_name: str,
    mode: str,
    api_key: str | None = None,
    max_queue_len: int | None = None,
    on_engine_failure: Callable[[BaseException], None] | None = None,
) -> FastAPI:
    """The FastAPI app over ``engine`` (an ``LLMEngine``, owned by the app's engine thread).

    The app owns the engine: its shutdown stops the engine thread, then closes the engine
    (worker processes of tensor parallelism included). ``on_engine_failure(exc)`` runs on the
    engine thread if the engine dies.
    """
    metrics = ServerMetrics(model_name)
    state = ServerState(
        engine_loop=EngineLoop(engine, metrics, max_queue_len, on_failure=on_engine_failure),
        tokenizer=tokenizer,
        model_name=model_name,
        max_model_len=engine.config.max_model_len,
        vocab_size=engine.vocab_size,
        mode=str(mode),
        validate=engine.validate,
        metrics=metrics,
        api_key=api_key,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.engine_loop.start()
        yield
        state.engine_loop.stop()
        close = getattr(engine, "close", None)
        if close is not None:
            close()

    app = FastAPI(title="CoRun", lifespan=lifespan)
    app.state.corun = state
    _install_error_handlers(app, state)

    if api_key is not None:
        app.add_middleware(BearerAuth, api_key=api_key, metrics=metrics)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if state.engine_loop.is_alive else 503)

    @app.get("/ping")
    async def ping() -> Response:
        return await health()

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> ModelList:
        card = ModelCard(
            id=state.model_name, root=state.model_name, max_model_len=state.max_model_len
        )
        return ModelList(data=[card])

    @app.post("/tokenize")
    @app.post("/v1/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        state.check_model(body.model)
        if body.messages is not None:
            ids = _render_chat(state, body.messages, body.add_generation_prompt, False, None)
        else:
            ids = state.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return TokenizeResponse(count=len(ids), max_model_len=state.max_model_len, tokens=ids)

    @app.post("/detokenize")
    @app.post("/v1/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        state.check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < state.vocab_size]
        if bad:
            raise APIError(400, f"tokens: {bad[0]} is outside [0, {state.vocab_size})", "tokens")
        return DetokenizeResponse(prompt=state.tokenizer.decode(body.tokens))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        state.check_model(body.model)
        field = "prompt"
        subs = []
        for index, prompt in enumerate(body.prompts):
            ids = state.encode(prompt, field)
            params = state.sampling_params(body, ids, body.max_tokens, body.logprobs, field)
            subs.append(Submission(random_id("req"), index, ids, params))
        echo = [state.tokenizer.decode(s.prompt_ids) if body.echo else "" for s in subs]
        build = responses.CompletionBuilder(state, body, subs, echo)
        return await _respond(state, raw, subs, build, body.stream)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        state.check_model(body.model)
        ids = _render_chat(
            state,
            body.messages,
            body.add_generation_prompt,
            body.continue_final_message,
            body.chat_template_kwargs,
        )
        params = state.sampling_params(
            body, ids, body.max_new_tokens, body.num_logprobs, "messages"
        )
        subs = [Submission(random_id("req"), 0, ids, params)]
        build = responses.ChatBuilder(state, body, subs)
        return await _respond(state, raw, subs, build, body.stream)

    return app


class BearerAuth:
    """401 unless ``Authorization: Bearer <api_key>``; health and metrics stay open.

    A plain ASGI middleware rather than ``@app.middleware("http")``: BaseHTTPMiddleware re-wraps
    ``receive`` and ``send`` of every request, streamed ones included, which the disconnect
    detection of ``_events`` reads; this one passes them through untouched.
    """

    def __init__(self, app: Any, api_key: str, metrics: ServerMetrics) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in AUTH_EXEMPT_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                self.metrics.observe_error(401)
                error = APIError(401, "Invalid or missing API key (Authorization: Bearer ...).",
                                 None, type="authentication_error", code="invalid_api_key")
                await JSONResponse(error.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _render_chat(
    state: ServerState,
    messages: list,
    add_generation_prompt: bool,
    continue_final: bool,
    template_kwargs: dict | None,
) -> list[int]:
    conversation = [{"role": m.role, "content": m.text} for m in messages]
    try:
        text = state.tokenizer.apply_chat_template(
            conversation,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **(template_kwargs or {}),
        )
    except ValueError as exc:
        raise APIError(400, str(exc), "messages") from None
    except Exception as exc:  # noqa: BLE001 - a template error is the request's fault
        raise APIError(400, f"messages: the chat template failed: {exc}", "messages") from None
    if continue_final and conversation:
        # Continue the last (assistant) message: drop the end-of-turn the template closed it with.
        last = conversation[-1]["content"]
        cut = text.rfind(last)
        text = text[: cut + len(last)] if cut >= 0 else text
    return state.tokenizer.encode(text, add_special_tokens=False)


async def _respond(
    state: ServerState,
    raw: Request,
    subs: list[Submission],
    build: Any,
    stream: bool,
) -> Response:
    """Submit every prompt, then answer with one JSON body or an SSE stream."""
    queue: asyncio.Queue = asyncio.Queue()
    try:
        for sub in subs:
            state.engine_loop.submit(sub.request_id, sub.prompt_ids, sub.params, queue)
    except (QueueFullError, EngineDeadError) as exc:
        for sub in subs:
            state.engine_loop.abort(sub.request_id)
        code = "queue_full" if isinstance(exc, QueueFullError) else "engine_dead"
        raise APIError(503, str(exc), None, type="service_unavailable", code=code) from None
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
    every DISCONNECT_POLL_S), the stream was cancelled, or an engine error ended the request.
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
            if isinstance(item, EngineError):
                raise APIError(
                    item.status,
                    item.message,
                    None,
                    type="invalid_request_error" if item.status < 500 else "server_error",
                )
            changed = build.update(by_id[request_id], item)
            if item.finished:
                unfinished.discard(request_id)
            yield changed
    finally:
        for request_id in unfinished:
            state.engine_loop.abort(request_id)
        if unfinished:
            state.metrics.observe_aborted(len(unfinished))


async def _sse_stream(build: Any, events: AsyncIterator[list[ChoiceState]]) -> AsyncIterator[str]:
    """SSE frames: one chunk per changed choice, the usage chunk if asked, then [DONE].

    An error after the stream started cannot change the status any more: it is sent as a
    ``data: {"error": ...}`` event, then [DONE], as vLLM does.
    """
    try:
        async for changed in events:
            for chunk in build.chunks(changed):
                yield sse(chunk)
        usage = build.usage_chunk()
        if usage is not None:
            yield sse(usage)
    except APIError as exc:
        yield sse(exc.body())
    finally:
        await events.aclose()
    yield SSE_DONE


def _install_error_handlers(app: FastAPI, state: ServerState) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        state.metrics.observe_error(exc.status)
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        """FastAPI answers 422; OpenAI servers answer 400 naming the first bad field."""
        error = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        loc = [part for part in error.get("loc", ()) if part != "body"]
        if error.get("type") == "json_invalid":
            message, param = f"Malformed JSON body: {error.get('ctx', {}).get('error', '')}", None
        else:
            param = _format_loc(loc)
            message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
            message = f"{param}: {message}" if param else message
        state.metrics.observe_error(400)
        return JSONResponse(APIError(400, message, param).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        state.metrics.observe_error(exc.status_code)
        body = APIError(exc.status_code, str(exc.detail), None, type="invalid_request_error").body()
        return JSONResponse(body, status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        state.metrics.observe_error(500)
        body = APIError(500, f"internal error: {exc!r}", None, type="server_error").body()
        return JSONResponse(body, status_code=500)


# Pydantic puts the member of a union that failed into the location ('str', 'list[int]', ...).
_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "null"}


def _format_loc(loc: list) -> str | None:
    """('messages', 0, 'content', 'str') -> 'messages[0].content'."""
    out = ""
    for part in loc:
        text = str(part)
        if isinstance(part, int):
            out += f"[{part}]"
        elif text in _UNION_TAGS or "[" in text or "-" in text:
            continue
        else:
            out = f"{out}.{text}" if out else text
    return out or None
