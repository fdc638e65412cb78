"""Structured output at the edge: the constraint a request asks for, under each API's names,
as one protocol.Grammar, and the check that it compiles (a 400 naming the problem before
anything is queued).

- native `sampling_params`: `json_schema` (text, or an object), `regex`, `ebnf`,
  `structural_tag` — at most one (SGLang's rule);
- OpenAI `response_format`: `json_object`, `json_schema` (`{name, schema, strict}`),
  `structural_tag`; and vLLM's `structured_outputs` / `guided_json | guided_regex |
  guided_choice | guided_grammar`, which the same clients send to vLLM.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
from collections.abc import Sequence
from typing import Any

from api.errors import BadRequest
from api.req_state import GenerateReq
from shared.grammars import InvalidGrammar, to_xgrammar
from shared.protocol import Grammar, GrammarKind

ONLY_ONE = "Only one of regex, json_schema, or ebnf can be set."
_PARAM = {"json_schema": "json_schema", "regex": "regex", "ebnf": "ebnf",
          "structural_tag": "structural_tag", "json_object": "response_format"}  # fmt: skip


def as_text(value: Any) -> str:
    """A schema or tag sent as an object or as its JSON text: the text."""
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


def one_grammar(fields: dict[GrammarKind, Any]) -> Grammar | None:
    """The one constraint among `fields` (kind -> value, None when unset)."""
    given = [(kind, value) for kind, value in fields.items() if value is not None]
    if len(given) > 1:
        raise BadRequest(ONLY_ONE, param=given[1][0])
    if not given:
        return None
    kind, value = given[0]
    return Grammar(kind, as_text(value))


def choice_regex(choices: list[str]) -> str:
    """vLLM's guided_choice: exactly one of the strings."""
    return "|".join(f"({re.escape(c)})" for c in choices)


def response_format_grammar(fmt: Any) -> Grammar | None:
    """OpenAI's response_format (already shape-checked by its schema)."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Grammar("json_object")
    if fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise BadRequest(
                "response_format.json_schema.schema is required for type json_schema.",
                param="response_format",
            )
        return Grammar("json_schema", as_text(fmt.json_schema.json_schema))
    return Grammar("structural_tag", as_text(fmt.model_dump(exclude={"json_schema"})))


async def check_grammars(reqs: Sequence[GenerateReq]) -> None:
    """BadRequest if a request's grammar does not compile (off the event loop: the first
    check imports xgrammar and torch, a big schema takes a while)."""
    specs = {(g.kind, g.text) for req in reqs if (g := req.sampling.grammar) is not None}
    for kind, text in specs:
        error = await asyncio.to_thread(_grammar_error, kind, text)
        if error is not None:
            raise BadRequest(f"Invalid {kind}: {error}", param=_PARAM[kind])


@functools.lru_cache(maxsize=256)
def _grammar_error(kind: GrammarKind, text: str) -> str | None:
    try:
        to_xgrammar(Grammar(kind, text))
    except InvalidGrammar as e:
        return str(e)
    return None
