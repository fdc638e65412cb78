"""Field types shared by the native and OpenAI schemas: UTF-8-safe strings, request ids,
one-or-many unions with readable errors, and the "accepted only at its neutral value" rule."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Annotated, Any, Self, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StringConstraints,
    Tag,
    model_validator,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")
_MAX_LOGGED_FIELDS = 5


class RequestBody(BaseModel):
    """A request body: non-finite floats are refused, unknown fields are logged and dropped
    (never forwarded to the engine)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @model_validator(mode="after")
    def _drop_unknown_fields(self) -> Self:
        extra = self.__pydantic_extra__
        if extra:
            names = ", ".join(ascii(name)[:40] for name in list(extra)[:_MAX_LOGGED_FIELDS])
            logger.warning("ignoring unknown fields of %s: %s", type(self).__name__, names)
            extra.clear()
        return self


def _check_unicode(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode (it contains a lone surrogate)") from None
    return value


# Every string that may reach a tokenizer, a log line or Redis goes through this.
SafeStr = Annotated[str, AfterValidator(_check_unicode)]
Rid = Annotated[
    str, StringConstraints(min_length=1, max_length=256), AfterValidator(_check_unicode)
]
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
# A request's `timeout` in seconds.
Timeout = Annotated[float, Field(gt=0)]


def _one_or_list(value: Any) -> str:
    return "<many>" if isinstance(value, list) else "<one>"


# Union members are tagged "<...>": the discriminator makes pydantic report errors for one
# branch only, and the error handler drops the tags from error locations.

# `x` or `[x, ...]`.
OneOrList = Annotated[
    Annotated[T, Tag("<one>")] | Annotated[list[T], Tag("<many>")],
    Discriminator(_one_or_list),
]


def _ids_shape(value: Any) -> str:
    return (
        "<ids_batch>"
        if isinstance(value, list) and value and isinstance(value[0], list)
        else "<ids>"
    )


TokenIdsInput = Annotated[
    Annotated[list[int], Tag("<ids>")] | Annotated[list[list[int]], Tag("<ids_batch>")],
    Discriminator(_ids_shape),
]


def _prompt_shape(value: Any) -> str:
    if not isinstance(value, list):
        return "<text>"
    if value:
        if isinstance(value[0], list):
            return "<ids_batch>"
        if isinstance(value[0], int):
            return "<ids>"
    return "<texts>"


# OpenAI's completion prompt: str | list[str] | list[int] | list[list[int]].
PromptInput = Annotated[
    Annotated[SafeStr, Tag("<text>")]
    | Annotated[list[SafeStr], Tag("<texts>")]
    | Annotated[list[int], Tag("<ids>")]
    | Annotated[list[list[int]], Tag("<ids_batch>")],
    Discriminator(_prompt_shape),
]


def _embed_shape(value: Any) -> str:
    if not isinstance(value, list):
        return "<text>"
    if value:
        first = value[0]
        if isinstance(first, int):
            return "<ids>"
        if isinstance(first, list):
            return "<pairs>" if first and isinstance(first[0], str) else "<ids_batch>"
    return "<texts>"


# A cross-encoder input: [query, document].
TextPairInput = Annotated[list[SafeStr], Field(min_length=2, max_length=2)]

# What can be embedded or tokenized: str | list[str] | list[int] | list[list[int]] and
# cross-encoder pairs [[query, doc], ...].
EmbedInput = Annotated[
    Annotated[SafeStr, Tag("<text>")]
    | Annotated[list[SafeStr], Tag("<texts>")]
    | Annotated[list[int], Tag("<ids>")]
    | Annotated[list[list[int]], Tag("<ids_batch>")]
    | Annotated[list[TextPairInput], Tag("<pairs>")],
    Discriminator(_embed_shape),
]


def reject_unsupported(model: BaseModel, neutral: Mapping[str, tuple[Any, ...]]) -> None:
    """Fields we accept only at a value that changes nothing (clients often send defaults);
    anything else is an error rather than a silently different result."""
    for name, allowed in neutral.items():
        value = getattr(model, name)
        if value is not None and value not in allowed:
            raise ValueError(f"{name} is not supported yet (leave it unset or use {allowed[0]!r})")


def reject_present(model: BaseModel, names: tuple[str, ...]) -> None:
    for name in names:
        if getattr(model, name) is not None:
            raise ValueError(f"{name} is not supported by this server")
