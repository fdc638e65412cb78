"""Field types shared by the native and OpenAI schemas: UTF-8-safe strings, request ids,
one-or-many unions with readable errors, and the "accepted only at its neutral value" rule."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, TypeVar

from pydantic import AfterValidator, BaseModel, Discriminator, Field, StringConstraints, Tag

T = TypeVar("T")


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
