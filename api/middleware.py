"""The edge of the api, before any route runs (pure ASGI, no body buffering):

1. API keys: with keys configured, every route but OPEN_PATHS needs `Authorization: Bearer <key>`;
   keys are compared as SHA-256 digests with hmac.compare_digest, against every key, so neither
   the time nor the text of the 401 tells a missing key from a wrong one.
2. Content type: bodies are JSON. `curl -d` sends application/x-www-form-urlencoded, and some
   clients send text/plain or nothing: such bodies are read as JSON (and fail as invalid JSON
   when they are not). Any other non-JSON type (multipart, XML, ...) is a 415, but for the
   file uploads of UPLOAD_PATHS, which are multipart/form-data.
   The key's digest names the request's client for the per-key limits (api.admission.CLIENT).
3. Body size: above `max_body_bytes` (uploads: `max_upload_bytes`) a 413, from Content-Length
   before reading anything, else as soon as the streamed body passes the limit (before it is
   parsed)."""

from __future__ import annotations

import hashlib
import hmac
import logging

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.admission import CLIENT
from api.errors import BodyError, error_body
from shared.limits import ANONYMOUS, client_id

logger = logging.getLogger(__name__)

# Probes and scrapes need no key (as in SGLang: /health*, /metrics).
OPEN_PATHS = frozenset({"/health", "/health_generate", "/live", "/metrics"})
_LENIENT_TYPES = frozenset({"", "application/x-www-form-urlencoded", "text/plain"})
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
# Multipart uploads (OpenAI's Files API), and what a multipart envelope adds to a file.
UPLOAD_PATHS = frozenset({"/v1/files"})
_MULTIPART = "multipart/form-data"
_ENVELOPE_BYTES = 64 * 1024
_AUTH_MESSAGE = "Missing or invalid API key. Send it as 'Authorization: Bearer <key>'."


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def media_type(value: bytes) -> str:
    return value.decode("latin-1").split(";", 1)[0].strip().lower()


def is_json_type(media: str) -> bool:
    main, _, sub = media.partition("/")
    return main == "application" and (sub == "json" or sub.endswith("+json"))


class EdgeGuard:
    def __init__(
        self,
        app: ASGIApp,
        *,
        api_keys: list[str],
        max_body_bytes: int,
        max_upload_bytes: int | None = None,
    ) -> None:
        self.app = app
        self._digests = [_digest(key.encode()) for key in api_keys]
        self.max_body_bytes = max_body_bytes
        self.max_upload_bytes = max_upload_bytes or max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        client = ANONYMOUS
        if self._digests and scope["path"] not in OPEN_PATHS:
            if not self._authorized(scope):
                logger.info("401 %s %s: missing or invalid API key", scope["method"],
                            scope["path"])  # fmt: skip
                await _reply(scope, receive, send, 401, _AUTH_MESSAGE, code="invalid_api_key",
                             headers={"WWW-Authenticate": "Bearer"})  # fmt: skip
                return
            client = client_id(_bearer(scope))
        if scope["method"] in _BODY_METHODS:
            upload = scope["path"] in UPLOAD_PATHS
            limit = self.max_upload_bytes + _ENVELOPE_BYTES if upload else self.max_body_bytes
            scope = await self._check_body(scope, receive, send, upload, limit)
            if not scope:
                return
            receive = self._limited(receive, limit, upload)
        token = CLIENT.set(client)  # reset after: an in-process ASGI client shares its task
        try:
            await self.app(scope, receive, send)
        finally:
            CLIENT.reset(token)

    def _authorized(self, scope: Scope) -> bool:
        digest = _digest(_bearer(scope))
        ok = False
        for known in self._digests:  # no early exit: every key costs the same
            ok |= hmac.compare_digest(known, digest)
        return ok

    async def _check_body(
        self, scope: Scope, receive: Receive, send: Send, upload: bool, limit: int
    ) -> Scope:
        """The scope to go on with (content type made JSON), or {} after an error reply."""
        headers = scope["headers"]
        raw_type = next((v for k, v in headers if k == b"content-type"), b"")
        media = media_type(raw_type)
        if upload:
            if media != _MULTIPART:
                await _reply(scope, receive, send, 415, f"Unsupported Media Type: "
                             f"{ascii(media)[:80]}; upload files as {_MULTIPART}.")  # fmt: skip
                return {}
        elif media in _LENIENT_TYPES:
            rest = [(k, v) for k, v in headers if k != b"content-type"]
            scope = {**scope, "headers": [*rest, (b"content-type", b"application/json")]}
        elif not is_json_type(media):
            message = f"Unsupported Media Type: {ascii(media)[:80]}; send application/json."
            await _reply(scope, receive, send, 415, message)
            return {}
        length = next((v for k, v in headers if k == b"content-length"), None)
        if length is not None and length.isdigit() and int(length) > limit:
            await _reply(scope, receive, send, 413, _too_large(upload, limit))
            return {}
        return scope

    def _limited(self, receive: Receive, limit: int, upload: bool) -> Receive:
        total = 0

        async def limited_receive() -> Message:
            nonlocal total
            message = await receive()
            if message["type"] == "http.request":
                total += len(message.get("body", b""))
                if total > limit:
                    raise BodyError(413, _too_large(upload, limit))
            return message

        return limited_receive


def _too_large(upload: bool, limit: int) -> str:
    if upload:
        return f"The file is larger than the limit of {limit - _ENVELOPE_BYTES} bytes."
    return f"The request body is larger than the limit of {limit} bytes."


def _bearer(scope: Scope) -> bytes:
    """The token of the request's `Authorization: Bearer <token>` header (b"" if none)."""
    header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
    scheme, _, token = header.partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else b""


async def _reply(
    scope: Scope,
    receive: Receive,
    send: Send,
    status: int,
    message: str,
    *,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> None:
    body = error_body(scope["path"], status, message, code=code, openai=status == 401)
    await JSONResponse(body, status_code=status, headers=headers)(scope, receive, send)
