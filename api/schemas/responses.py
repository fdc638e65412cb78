"""OpenAI's Responses API request body (POST /v1/responses), stateless: the whole
conversation comes in `input`; api.responses turns it into a chat request."""

from __future__ import annotations

from typing import Any, Literal, Self

from pydantic import model_validator

from api.schemas.common import RequestBody, Rid, SafeStr, Timeout


class ResponsesRequest(RequestBody):
    model: SafeStr | None = None
    input: SafeStr | list[dict[str, Any]]
    instructions: SafeStr | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    stream: bool = False
    # {"format": {"type": "text" | "json_object" | "json_schema", name, schema, strict}}
    text: dict[str, Any] | None = None
    # Accepted and ignored: nothing is stored (a response cannot be fetched again).
    store: bool | None = None
    metadata: dict[str, SafeStr] | None = None
    user: SafeStr | None = None
    reasoning: dict[str, Any] | None = None
    # Refused: this server keeps no responses.
    previous_response_id: SafeStr | None = None
    background: bool | None = None
    # redserve's own, as on the other routes.
    rid: Rid | None = None
    timeout: Timeout | None = None

    @model_validator(mode="after")
    def _stateless(self) -> Self:
        if self.previous_response_id is not None:
            raise ValueError(
                "previous_response_id is not supported: this server keeps no responses; "
                "send the whole conversation in input"
            )
        if self.background:
            raise ValueError("background responses are not supported")
        return self
