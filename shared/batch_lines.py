"""The lines of a Batch API input file, and the lines of its output and error files (OpenAI's
formats). Pure: the api checks every line when the batch is created, the jobs tier reads them
again to run them.

An input line is `{"custom_id", "method": "POST", "url": <the batch's endpoint>, "body": {}}`;
custom_ids are unique within the file. Blank lines are skipped."""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Iterator
from typing import Any

import msgspec

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")


class BatchLine(msgspec.Struct, frozen=True):
    index: int  # 0-based position among the file's requests
    custom_id: str
    body: dict[str, Any]


class LineError(ValueError):
    def __init__(self, line: int, message: str, param: str | None = None) -> None:
        super().__init__(f"Line {line}: {message}")
        self.line = line  # 1-based, as an editor shows it
        self.param = param


def parse_line(raw: bytes, line_no: int, index: int, endpoint: str) -> BatchLine:
    """One line of an input file (`line_no` 1-based), or a LineError saying what is wrong."""
    try:
        data = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        raise LineError(line_no, "the line is not valid JSON.") from None
    if not isinstance(data, dict):
        raise LineError(line_no, "the line must be a JSON object.")
    custom_id = data.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise LineError(line_no, "'custom_id' must be a non-empty string.", "custom_id")
    if data.get("method") != "POST":
        raise LineError(line_no, "'method' must be 'POST'.", "method")
    if data.get("url") != endpoint:
        raise LineError(line_no, f"'url' must be the batch's endpoint {endpoint!r}, got "
                        f"{str(data.get('url'))[:100]!r}.", "url")  # fmt: skip
    body = data.get("body")
    if not isinstance(body, dict):
        raise LineError(line_no, "'body' must be a JSON object.", "body")
    if body.get("stream"):
        raise LineError(line_no, "streaming is not supported in a batch ('body.stream').",
                        "body.stream")  # fmt: skip
    return BatchLine(index, custom_id, body)


def read_lines(raw_lines: Iterable[bytes], endpoint: str, max_lines: int) -> Iterator[BatchLine]:
    """Every request of an input file in order; the first bad line raises its LineError."""
    seen: set[str] = set()
    index = 0
    for line_no, raw in enumerate(raw_lines, start=1):
        if not raw.strip():
            continue
        line = parse_line(raw, line_no, index, endpoint)
        if line.custom_id in seen:
            raise LineError(line_no, f"custom_id {line.custom_id!r} is not unique in the file.",
                            "custom_id")  # fmt: skip
        if index == max_lines:
            raise LineError(line_no, f"a batch holds at most {max_lines} requests.")
        seen.add(line.custom_id)
        index += 1
        yield line


def result_line(custom_id: str, rid: str, status_code: int, body: Any) -> bytes:
    """An output (status 200) or error file line for a request that got an answer."""
    response = {"status_code": status_code, "request_id": rid, "body": body}
    return _line(custom_id, response, None)


def failed_line(custom_id: str, code: str, message: str) -> bytes:
    """An error file line for a request that got no answer (expired, cancelled, failed)."""
    return _line(custom_id, None, {"code": code, "message": message})


def _line(custom_id: str, response: Any, error: Any) -> bytes:
    entry = {
        "id": f"batch_req_{secrets.token_hex(12)}",
        "custom_id": custom_id,
        "response": response,
        "error": error,
    }
    return msgspec.json.encode(entry) + b"\n"


def custom_id_of(raw: bytes) -> str | None:
    """The custom_id of a whole output/error line; None for a torn or foreign one."""
    try:
        value = msgspec.json.decode(raw).get("custom_id")
    except (msgspec.DecodeError, AttributeError):
        return None
    return value if isinstance(value, str) else None
