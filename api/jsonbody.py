"""Strict JSON request bodies. Every route of the api uses `JsonRoute`, whose requests parse
their body as UTF-8 JSON (a leading BOM is tolerated) and refuse, with a 400 that names the
offending field: NaN/Infinity and numbers that overflow to infinity, lone surrogates, invalid
UTF-8, integers with too many digits and nesting too deep for the parser. So no non-finite
number or unencodable string gets into the app anywhere, typed field or not."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

from api.errors import BodyError

_BOM = "\ufeff"
# How JSON spells a surrogate code unit (lone or half of a pair).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


class JsonRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict_handler(request: Request) -> Response:
            return await handler(StrictJsonRequest(request.scope, request.receive))

        return strict_handler


class StrictJsonRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = parse_json(await self.body())
        return self._json


class _Scan:
    """Remembers whether the parser met a non-finite number."""

    def __init__(self) -> None:
        self.non_finite: str | None = None

    def constant(self, name: str) -> float:  # NaN, Infinity, -Infinity
        self.non_finite = self.non_finite or name
        return float(name)

    def number(self, text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            self.non_finite = self.non_finite or text[:32]
        return value


def parse_json(body: bytes) -> Any:
    """The body as JSON, or BodyError (400). json.JSONDecodeError is left to FastAPI, which
    reports it as "Invalid JSON body" with the position."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BodyError(400, f"Invalid JSON body: not valid UTF-8 (byte {e.start}).") from None
    scan = _Scan()
    try:
        obj = json.loads(
            text.removeprefix(_BOM), parse_constant=scan.constant, parse_float=scan.number
        )
    except json.JSONDecodeError:
        raise
    except RecursionError:
        raise BodyError(400, "Invalid JSON body: nested too deeply.") from None
    except ValueError:  # an integer beyond Python's digit limit
        raise BodyError(400, "Invalid JSON body: a number has too many digits.") from None
    if scan.non_finite is not None:
        path = find(obj, _is_non_finite)
        raise BodyError(
            400, f"{path or 'a number'} must be a finite number (got {scan.non_finite}).", path
        )
    if _SURROGATE_ESCAPE.search(text):
        path = find(obj, _has_lone_surrogate)
        if path is not None:
            raise BodyError(
                400, f"{path or 'the body'} must be valid Unicode (it contains a lone surrogate).",
                path or None,
            )  # fmt: skip
    return obj


def _is_non_finite(value: Any) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


def _has_lone_surrogate(value: Any) -> bool:
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def find(obj: Any, bad: Callable[[Any], bool]) -> str | None:
    """The dotted path ("sampling_params.temperature", "prompt.1") of the first value for
    which `bad` holds (dict keys included; "" for the root), or None. Iterative: the parser
    already allowed the nesting, recursion here must not fail on it."""
    stack: list[tuple[Any, str]] = [(obj, "")]
    while stack:
        value, path = stack.pop()
        if bad(value):
            return path
        if isinstance(value, dict):
            for key, item in reversed(list(value.items())):
                child = f"{path}.{key}" if path else str(key)
                if bad(key):
                    return child
                stack.append((item, child))
        elif isinstance(value, list):
            for i in reversed(range(len(value))):
                stack.append((value[i], f"{path}.{i}" if path else str(i)))
    return None
