"""Grammars compiled against the model's vocabulary on a worker thread, never on the loop,
and cached by their text: many requests with one schema compile it once (xgrammar keeps
its own cache of compiled grammars too; ours also shares a compile that is in flight).
"""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from shared import grammars, protocol
from workers.scheduler.grammar import guidance
from workers.scheduler.grammar.constraint import Constraint
from workers.scheduler.grammar.guidance import GuidanceConstraint

if TYPE_CHECKING:
    import xgrammar

CACHE_SIZE = 256  # distinct grammars kept (LRU)


class GrammarCompiler:
    def __init__(
        self, tokenizer: Any, vocab_size: int, max_threads: int = 1, backend: str = "xgrammar"
    ) -> None:
        self._tokenizer, self._vocab_size, self._max_threads = tokenizer, vocab_size, max_threads
        self.backend = backend  # "llguidance": JSON schemas and regexes go through it
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._cache: OrderedDict[tuple[str, str], Future[Any]] = OrderedDict()
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._guidance_tokenizer: Any = None

    def constraint(self, spec: protocol.Grammar, output_ids: list[int]) -> Constraint:
        """A request's constraint; its grammar compiles in the background if it is new."""
        if self._guided(spec):
            return GuidanceConstraint(self.compile(spec), output_ids, self._llg_tokenizer())
        return Constraint(self.compile(spec), output_ids)

    def _guided(self, spec: protocol.Grammar) -> bool:
        return self.backend == "llguidance" and spec.kind in guidance.KINDS

    def compile(self, spec: protocol.Grammar) -> Future[Any]:
        """The compiled grammar (xgrammar's) or checked grammar text (llguidance's)."""
        key = (spec.kind, spec.text)
        future = self._cache.get(key)
        if future is None:
            work = self._compile_guidance if self._guided(spec) else self._compile
            future = self._cache[key] = self._pool.submit(work, spec)
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        return future

    def _compile(self, spec: protocol.Grammar) -> xgrammar.CompiledGrammar:
        return self._xgrammar_compiler().compile_grammar(grammars.to_xgrammar(spec))

    def _compile_guidance(self, spec: protocol.Grammar) -> str:
        return guidance.guidance_grammar(spec, self._llg_tokenizer())

    def _llg_tokenizer(self) -> Any:
        if self._guidance_tokenizer is None:
            import llguidance.hf

            self._guidance_tokenizer = llguidance.hf.from_tokenizer(
                self._tokenizer, n_vocab=self._vocab_size
            )
        return self._guidance_tokenizer

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
