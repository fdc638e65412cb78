"""Clients people use, unchanged, against the real stack: langchain-openai's ChatOpenAI with
structured output and bound tools (the official openai client's parse is in
test_structured.py)."""

from __future__ import annotations

from typing import Literal

import pytest
from pydantic import BaseModel, Field

from tests.support.stack import Stack

pytestmark = [pytest.mark.e2e, pytest.mark.model]


class City(BaseModel):
    """A city and the country it is in."""

    name: str = Field(max_length=20)
    country: str = Field(max_length=20)
    size: Literal["small", "medium", "large"]


class GetWeather(BaseModel):
    """Get the current weather in a city."""

    city: str = Field(max_length=20)


def _llm(stack: Stack):  # type: ignore[no-untyped-def]
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=stack.base_url + "/v1", api_key="unused", model="default",
                      temperature=0, max_tokens=60, timeout=120, max_retries=0)  # fmt: skip


def test_langchain_structured_output(stack: Stack) -> None:
    city = _llm(stack).with_structured_output(City).invoke("Tell me about Paris.")
    assert isinstance(city, City) and city.size in ("small", "medium", "large")


def test_langchain_structured_output_through_function_calling(stack: Stack) -> None:
    llm = _llm(stack).with_structured_output(City, method="function_calling")
    city = llm.invoke("Tell me about Paris.")
    assert isinstance(city, City)


def test_langchain_bind_tools(stack: Stack) -> None:
    llm = _llm(stack).bind_tools([GetWeather], tool_choice="GetWeather")
    message = llm.invoke("What is the weather in Rome?")
    [call] = message.tool_calls
    assert call["name"] == "GetWeather" and isinstance(call["args"]["city"], str)
    assert GetWeather(**call["args"])
