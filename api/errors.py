"""Errors of the HTTP edge: domain exceptions and the handlers that render every error as
SGLang's native body `{"error": {"message"}}`, or OpenAI's `{"error": {message, type, param,
code}}` on /v1 routes. Pydantic's 422 becomes 400 and the rejected input is never echoed
(a bare NaN in it would make starlette's JSON encoder fail with a 500)."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

logger = logging.getLogger(__name__)

_MAX_REPORTED_ERRORS = 3


class ApiError(Exception):
    """A request-level failure with an HTTP status; rendered by `install_error_handlers`."""

    status_code = 400

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        status_code: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        if status_code is not None:
            self.status_code = status_code

    @property
    def headers(self) -> dict[str, str] | None:
        return None


class BadRequest(ApiError):
    status_code = 400


class NotFound(ApiError):
    status_code = 404


class _RetryLater(ApiError):
    """An error that tells the client when to try again (`Retry-After`, whole seconds >= 1)."""

    def __init__(self, message: str, *, retry_after: float = 1, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.retry_after = max(1, math.ceil(retry_after))

    @property
    def headers(self) -> dict[str, str] | None:
        return {"Retry-After": str(self.retry_after)}


class ServiceUnavailable(_RetryLater):
    """Redis is unreachable or full, the replica is starting or draining, or the fleet's
    queue is full: retry soon (on this replica or another)."""

    status_code = 503


class TooManyRequests(_RetryLater):
    """An API key went over its rate limit or its cap on requests in flight."""

    status_code = 429

    def __init__(self, message: str, *, retry_after: float = 1, **kwargs: Any) -> None:
        kwargs.setdefault("code", "rate_limit_exceeded")
        super().__init__(message, retry_after=retry_after, **kwargs)


class ClientDisconnected(ApiError):
    """The client went away while its request was running (nginx's 499; nobody reads it)."""

    status_code = 499


class BodyError(StarletteHTTPException):
    """A body that cannot be read (too large, not JSON, not finite, not Unicode). Raised while
    FastAPI reads the body, which re-raises HTTP exceptions as they are."""

    def __init__(self, status_code: int, message: str, param: str | None = None) -> None:
        super().__init__(status_code=status_code, detail=message)
        self.param = param


def _openai_type(status_code: int) -> str:
    if status_code >= 500:
        return "server_error"
    if status_code == 404:
        return "not_found_error"
    if status_code == 429:
        return "requests"  # OpenAI's type for a request rate limit
    return "invalid_request_error"


def _safe(message: str) -> str:
    """A message that always encodes as UTF-8 (lone surrogates become escapes)."""
    return message.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(
    path: str,
    status_code: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    openai: bool = False,
) -> dict[str, Any]:
    """SGLang's `{"error": {"message"}}`, or OpenAI's envelope on /v1 (or when asked)."""
    message = _safe(message)
    param = _safe(param) if param is not None else None
    if openai or path.startswith("/v1/"):
        return {
            "error": {
                "message": message,
                "type": _openai_type(status_code),
                "param": param,
                "code": code,
            }
        }
    return {"error": {"message": message}}


def error_response(
    request: Request,
    status_code: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = error_body(request.url.path, status_code, message, param=param, code=code)
    return JSONResponse(body, status_code=status_code, headers=headers)


def describe_validation_errors(errors: Sequence[Any]) -> tuple[str, str | None]:
    """One readable message (and the first offending parameter) from pydantic's errors,
    without the rejected input."""
    parts: list[str] = []
    first_param: str | None = None
    for err in errors[:_MAX_REPORTED_ERRORS]:
        if err.get("type") == "json_invalid":
            detail = err.get("ctx", {}).get("error", "JSON decode error")
            return f"Invalid JSON body: {detail}", None
        # Drop "body" and the "<...>" union tags of api.schemas.common from the location.
        loc = [str(p) for p in err.get("loc", ()) if p != "body" and not str(p).startswith("<")]
        param = ".".join(loc) or None
        first_param = first_param or param
        if err.get("type") == "finite_number":
            parts.append(f"{param or 'a number'} must be a finite number")
            continue
        msg = str(err.get("msg", "invalid value"))
        for prefix in ("Value error, ", "Assertion failed, "):
            msg = msg.removeprefix(prefix)
        parts.append(f"{param}: {msg}" if param else msg)
    if len(errors) > _MAX_REPORTED_ERRORS:
        parts.append(f"({len(errors) - _MAX_REPORTED_ERRORS} more errors)")
    return "; ".join(parts) or "Invalid request", first_param


async def _on_validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    message, param = describe_validation_errors(exc.errors())
    return error_response(request, 400, message, param=param)


async def _on_api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return error_response(request, exc.status_code, exc.message, param=exc.param, code=exc.code,
                          headers=exc.headers)  # fmt: skip


async def _on_http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    param = exc.param if isinstance(exc, BodyError) else None
    return error_response(request, exc.status_code, str(exc.detail), param=param)


async def _on_unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    if isinstance(exc, ClientDisconnect):  # a send failed because the client went away
        logger.info("client went away during %s", request.url.path)
        return error_response(request, 499, "Client disconnected")
    logger.exception("unhandled error on %s", request.url.path, exc_info=exc)
    return error_response(request, 500, "Internal server error")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(ApiError, _on_api_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected_error)
