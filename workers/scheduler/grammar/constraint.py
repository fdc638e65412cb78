"""One constrained request's grammar state, as the core sees it (core.sequence.GrammarState).

The compiled grammar arrives in a Future (compiler.py); the matcher is built on first use
and first fed the output that already exists — ids a previous owner generated before a
crash, found in `rs:ids` — so a resumed request goes on exactly where the grammar stood.
Preemption and retraction keep the Sequence and so its matcher.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from shared.grammars import InvalidGrammar


class Constraint:
    """xgrammar's; guidance.GuidanceConstraint swaps the matcher for llguidance's."""

    backend = "xgrammar"

    def __init__(self, compiled: Future[Any], output_ids: list[int]) -> None:
        self._compiled = compiled
        self._replay = list(output_ids)  # accepted when the matcher is built
        self._matcher: Any = None
        self._failure: str | None = None

    @property
    def ready(self) -> bool:
        return self._compiled.done()

    @property
    def failure(self) -> str | None:
        """Why the grammar cannot constrain this request (it did not compile, or the
        output to resume from does not fit it); None while compiling or when fine."""
        if self._failure is None and self._compiled.done():
            error = self._compiled.exception()
            if isinstance(error, InvalidGrammar):
                self._failure = f"Invalid grammar: {error}"
            elif error is not None:
                self._failure = f"The grammar could not be compiled: {error}"
            else:
                self.matcher()
        return self._failure

    def matcher(self) -> Any:
        if self._matcher is None:
            self._matcher = self._new_matcher(self._compiled.result())
            if not all(self._accept(token_id) for token_id in self._replay):
                self._failure = "The output so far does not fit the grammar."
            self._replay = []
        return self._matcher

    def accept(self, token_id: int) -> bool:
        self.matcher()
        return self._accept(token_id)

    def is_terminated(self) -> bool:
        return bool(self.matcher().is_terminated())

    def _new_matcher(self, compiled: Any) -> Any:
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled)

    def _accept(self, token_id: int) -> bool:
        return bool(self._matcher.accept_token(token_id))
