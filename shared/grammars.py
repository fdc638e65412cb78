"""A protocol.Grammar as an xgrammar Grammar: the one translation that the api (to reject a
bad constraint with a 400 before it is queued) and the schedulers (to compile it against
their vocabulary) share, so both reach the same verdict on the same text.

JSON is generated compact (no free whitespace between tokens): a small model given free
whitespace can pad forever, and compact JSON parses the same. `json_object` is any JSON
object. xgrammar (and torch, which it imports) is imported on first use only.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

from shared.protocol import Grammar

if TYPE_CHECKING:
    import xgrammar

JSON_OBJECT_SCHEMA = '{"type": "object"}'

# xgrammar's errors start with "[hh:mm:ss] /path/file.cc:123: " and may say "Check failed:".
_NOISE = re.compile(r"^\[[\d:]+\] \S+:\d+: |Check failed: \(.*?\) is false: ")


class InvalidGrammar(ValueError):
    """The constraint does not compile; the message says why (for a 400)."""


def to_xgrammar(spec: Grammar) -> xgrammar.Grammar:
    """The xgrammar Grammar of `spec`; InvalidGrammar when it has none."""
    import xgrammar as xgr

    try:
        if spec.kind in ("json_schema", "json_object"):
            schema = spec.text if spec.kind == "json_schema" else JSON_OBJECT_SCHEMA
            return xgr.Grammar.from_json_schema(schema, any_whitespace=False)
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.text)
        if spec.kind == "ebnf":
            return xgr.Grammar.from_ebnf(spec.text)
        return xgr.Grammar.from_structural_tag(_current_tag(spec.text))
    except (RuntimeError, ValueError, TypeError) as e:
        raise InvalidGrammar(_clean(str(e))) from None


def _current_tag(text: str) -> str:
    """SGLang's and vLLM's structural tag (`structures` + `triggers`, each structure a
    begin, a JSON schema and an end) in xgrammar's current form; any other text as it is."""
    try:
        tag = json.loads(text)
    except ValueError:
        return text
    if not isinstance(tag, dict) or "structures" not in tag or "format" in tag:
        return text
    tags = [
        {"type": "tag", "begin": s.get("begin", ""), "end": s.get("end", ""),
         "content": {"type": "json_schema", "json_schema": s.get("schema", {})}}
        for s in tag["structures"] if isinstance(s, dict)
    ]  # fmt: skip
    fmt = {"type": "triggered_tags", "triggers": tag.get("triggers", []), "tags": tags}
    return json.dumps({"type": "structural_tag", "format": fmt})


def _clean(message: str) -> str:
    lines = [_NOISE.sub("", line).strip() for line in message.strip().splitlines()]
    return " ".join(line for line in lines if line) or "invalid grammar"
