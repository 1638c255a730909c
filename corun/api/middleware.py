"""Plain ASGI middlewares of the server: API key, request body limit, ``Retry-After`` on 503.

Plain ASGI rather than ``@app.middleware("http")``: BaseHTTPMiddleware re-wraps ``receive`` and
``send`` of every request, streamed ones included, which the disconnect detection of the server
reads; these pass them through (the body limit only counts the bytes ``receive`` returns).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

from corun.api.errors import RETRY_AFTER_S, APIError

AUTH_EXEMPT_PATHS = ("/health", "/ping", "/metrics", "/version")


class BearerAuth:
    """401 unless ``Authorization: Bearer <api_key>``; health, metrics and version stay open."""

    def __init__(self, app: Any, api_key: str, observe_error: Callable[[int], None]) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.observe_error = observe_error

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in AUTH_EXEMPT_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                self.observe_error(401)
                error = APIError(401, "Invalid or missing API key (Authorization: Bearer ...).",
                                 None, type="authentication_error", code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def body_too_large(max_bytes: int) -> APIError:
    return APIError(
        413,
        f"Request body too large: the limit is {max_bytes} bytes (--max-request-body-bytes).",
        None,
        code="request_too_large",
    )


class BodySizeLimit:
    """413 for a request body over ``max_bytes``.

    A declared ``Content-Length`` over the limit is answered before a byte of the body is read; a
    chunked body is counted as it arrives and refused once it crosses the limit (``receive``
    raises the 413 APIError, which the error handlers answer), so no handler ever holds more
    than ``max_bytes`` of one request in memory.
    """

    def __init__(self, app: Any, max_bytes: int, observe_error: Callable[[int], None]) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.observe_error = observe_error

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            self.observe_error(413)
            await body_too_large(self.max_bytes).response()(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:  # the server's error handlers answer it
                    raise body_too_large(self.max_bytes)
            return message

        await self.app(scope, limited_receive, send)


class RetryAfter:
    """Adds ``Retry-After`` to every 503 that does not carry one (``/health`` of a dead or
    draining server, for one): a client or balancer knows to come back rather than give up."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_retry_after(message: dict) -> None:
            if message["type"] == "http.response.start" and message["status"] == 503:
                headers = list(message.get("headers", []))
                if not any(name.lower() == b"retry-after" for name, _ in headers):
                    headers.append((b"retry-after", str(RETRY_AFTER_S).encode()))
                    message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_retry_after)
