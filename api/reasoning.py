"""Reasoning content split out of a thinking model's answer (SGLang's --reasoning-parser):
what the model writes between `<think>` and `</think>` goes to `reasoning_content`, the rest
to `content`, so the answer (and a tool call or JSON after the thinking) stays clean.

- `qwen3`: a think block may open the output; without one it is all content.
- `deepseek-r1`: the template already opened the block, so the output starts inside it and
  everything up to `</think>` is reasoning (all of it, if the output never closes it).
Streams hold back only what may still be a tag (ReasoningStream).
"""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek-r1")


def split_reasoning(parser: str, text: str) -> tuple[str | None, str]:
    """(reasoning or None, content) of a finished output."""
    body = text.lstrip()
    if parser == "qwen3" and not body.startswith(START):
        return None, text
    if body.startswith(START):
        body = body[len(START) :]
    reasoning, closed, content = body.partition(END)
    if not closed:
        return reasoning.strip() or None, ""
    return reasoning.strip() or None, content.lstrip()


@dataclass
class ReasoningStream:
    """One streamed choice: feed it each delta, get (reasoning, content) deltas back."""

    parser: str
    text: str = ""
    reasoning_shown: int = 0
    content_shown: int = 0

    def feed(self, delta: str, finished: bool) -> tuple[str, str]:
        self.text += delta
        reasoning, content = self._visible(finished)
        new_reasoning = reasoning[self.reasoning_shown :]
        new_content = content[self.content_shown :]
        self.reasoning_shown, self.content_shown = len(reasoning), len(content)
        return new_reasoning, new_content

    def _visible(self, finished: bool) -> tuple[str, str]:
        """The reasoning and content that no later text can change."""
        text = self.text
        if finished:
            reasoning, content = split_reasoning(self.parser, text)
            return _raw_reasoning(self.parser, text) if reasoning else "", content
        body = text.lstrip()
        if self.parser == "qwen3" and not body.startswith(START):
            if START.startswith(body):
                return "", ""  # may still open a think block
            return "", text
        if END in text:
            return _raw_reasoning(self.parser, text), split_reasoning(self.parser, text)[1]
        inner = body[len(START) :] if body.startswith(START) else body
        if self.parser == "deepseek-r1" and START.startswith(body):
            inner = ""
        return _hold_back(inner.lstrip(), END), ""


def _raw_reasoning(parser: str, text: str) -> str:
    """The reasoning as it streams: inside the block, before `</think>` (not stripped at the
    end, so what was shown stays a prefix of it)."""
    body = text.lstrip()
    if body.startswith(START):
        body = body[len(START) :]
    return body.partition(END)[0].lstrip()


def _hold_back(text: str, tag: str) -> str:
    """`text` short of a tail that may be the start of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return text[:-k]
    return text
