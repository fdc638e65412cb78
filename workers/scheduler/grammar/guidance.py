"""llguidance as the backend of JSON schemas and regexes (`--grammar-backend llguidance`):
its masks inside a bounded repetition (a string's `maxLength`) cost microseconds where
xgrammar's cost milliseconds per row (bench/README.md, "Structured output"). EBNF and
structural tags (tool calls) stay with xgrammar. The same contract as constraint.Constraint,
and the same int32 bitmask layout, so one batch mask holds rows of both backends.
"""

from __future__ import annotations

import json
from concurrent.futures import Future
from typing import Any

from shared.grammars import JSON_OBJECT_SCHEMA, InvalidGrammar
from shared.protocol import Grammar
from workers.scheduler.grammar.constraint import Constraint

KINDS = ("json_schema", "json_object", "regex")


def guidance_grammar(spec: Grammar, tokenizer: Any) -> str:
    """The llguidance grammar of `spec`, checked against the vocabulary (worker thread)."""
    import llguidance

    if spec.kind == "regex":
        grammar = llguidance.LLMatcher.grammar_from_regex(spec.text)
    else:
        schema = _strict(spec.text) if spec.kind == "json_schema" else JSON_OBJECT_SCHEMA
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False}
        )
    error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
    if error:
        raise InvalidGrammar(" ".join(error.split()))
    return str(grammar)


def _strict(text: str) -> str:
    """The schema with `additionalProperties: false` on every object that lists its
    properties and says nothing of others: what xgrammar's strict mode (and OpenAI's
    `strict`) does, so both backends allow the same keys."""
    try:
        schema = json.loads(text)
    except ValueError:
        return text  # llguidance says what is wrong with it

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if "properties" in node and "additionalProperties" not in node:
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return json.dumps(schema)


class GuidanceConstraint(Constraint):
    backend = "llguidance"

    def __init__(self, grammar: Future[str], output_ids: list[int], tokenizer: Any) -> None:
        super().__init__(grammar, output_ids)
        self._tokenizer = tokenizer

    def is_terminated(self) -> bool:
        return bool(self.matcher().is_stopped())

    def _new_matcher(self, compiled: Any) -> Any:
        import llguidance

        return llguidance.LLMatcher(self._tokenizer, compiled)

    def _accept(self, token_id: int) -> bool:
        return bool(self._matcher.consume_token(token_id))
