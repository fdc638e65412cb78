"""Grammars compiled against the model's vocabulary on a worker thread, never on the loop,
and cached by their text: many requests with one schema compile it once (xgrammar keeps
its own cache of compiled grammars too; ours also shares a compile that is in flight).
"""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from shared import grammars, protocol
from workers.scheduler.grammar.constraint import Constraint

if TYPE_CHECKING:
    import xgrammar

CACHE_SIZE = 256  # distinct grammars kept (LRU)


class GrammarCompiler:
    def __init__(self, tokenizer: Any, vocab_size: int, max_threads: int = 1) -> None:
        self._tokenizer, self._vocab_size, self._max_threads = tokenizer, vocab_size, max_threads
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._cache: OrderedDict[tuple[str, str], Future[xgrammar.CompiledGrammar]] = (
            OrderedDict()
        )
        self._compiler: xgrammar.GrammarCompiler | None = None

    def constraint(self, spec: protocol.Grammar, output_ids: list[int]) -> Constraint:
        """A request's constraint; its grammar compiles in the background if it is new."""
        return Constraint(self.compile(spec), output_ids)

    def compile(self, spec: protocol.Grammar) -> Future[xgrammar.CompiledGrammar]:
        key = (spec.kind, spec.text)
        future = self._cache.get(key)
        if future is None:
            future = self._cache[key] = self._pool.submit(self._compile, spec)
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        return future

    def _compile(self, spec: protocol.Grammar) -> xgrammar.CompiledGrammar:
        return self._xgrammar_compiler().compile_grammar(grammars.to_xgrammar(spec))

    def _xgrammar_compiler(self) -> xgrammar.GrammarCompiler:
        if self._compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(
                self._tokenizer, vocab_size=self._vocab_size
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=self._max_threads)
        return self._compiler

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
