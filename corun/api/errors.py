"""OpenAI-style error bodies ``{"error": {"message", "type", "param", "code"}}`` and the handlers
that turn every failure of a request into one.

- ``APIError``: raised by the server's own checks (status, message, the field it names);
- pydantic's ``ValidationError`` (or FastAPI's ``RequestValidationError``): 400 naming the first
  bad field as ``messages[0].content``;
- Starlette's ``HTTPException`` (404 unknown path, 405 wrong method, 413 body too large): its
  headers (``Allow`` on a 405) are kept;
- anything else: 500 for that request only.

Every 503 carries ``Retry-After`` (``corun.api.middleware.RetryAfter`` adds it to responses that
do not pass through here). Messages are made encodable first: a request's text may hold a lone
surrogate, and an error echoing it must still be valid UTF-8.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from corun.api.response_models import ErrorInfo, ErrorResponse

logger = logging.getLogger("corun.serve")

# Seconds a client should wait before retrying a 503 (full queue, shutting down, engine gone).
RETRY_AFTER_S = 1


def safe_text(text: str) -> str:
    """``text`` with lone surrogates escaped (``\\ud800``), so that it encodes as UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class APIError(Exception):
    """An error answered with an OpenAI-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        if type is None:
            type = "invalid_request_error" if status < 500 else "server_error"
        self.status, self.message, self.param, self.type, self.code = (
            status,
            safe_text(message),
            None if param is None else safe_text(param),
            type,
            code,
        )
        self.headers = dict(headers or {})
        if status == 503:
            self.headers.setdefault("Retry-After", str(RETRY_AFTER_S))

    def body(self) -> dict:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers or None)


def param_of(message: str, default: str | None) -> str | None:
    """The engine's ValueErrors start with the field they name (``"top_p: expected ..."``, or a
    path such as ``"response_format.json_schema: ..."``)."""
    head, sep, _ = message.partition(":")
    head = head.strip()
    is_path = bool(head) and all(part.isidentifier() for part in head.split("."))
    return head if sep and is_path else default


def validation_error(errors: Sequence[Any]) -> APIError:
    """The 400 for pydantic's errors: the first one, its location as a field path."""
    error = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = [part for part in error.get("loc", ()) if part != "body"]
    if error.get("type") == "json_invalid":
        detail = error.get("ctx", {}).get("error", "")
        return APIError(400, f"Malformed JSON body: {detail}", None)
    param = format_loc(loc)
    message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
    if param is None:  # a model-level check: its message names the field
        param = param_of(message, None)
    elif not message.startswith(f"{param}:"):
        message = f"{param}: {message}"
    return APIError(400, message, param)


# Pydantic puts the member of a union that failed into the location ('str', 'list[int]', ...).
_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "null"}


def format_loc(loc: Sequence) -> str | None:
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


def install_error_handlers(app: FastAPI, observe_error: Any) -> None:
    """``observe_error(status)`` counts every error answered (the metrics)."""

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        observe_error(exc.status)
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def request_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        """FastAPI answers 422; OpenAI servers answer 400 naming the first bad field."""
        error = validation_error(exc.errors())
        observe_error(error.status)
        return error.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        error = APIError(exc.status_code, str(exc.detail), None, headers=exc.headers)
        observe_error(error.status)
        return error.response()

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        error = APIError(500, f"internal error: {exc!r}", None)
        observe_error(error.status)
        return error.response()
