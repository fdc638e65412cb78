"""Every tokenizer call of the api, off the event loop on one thread (a shared Hugging Face
tokenizer is not safe to use from several threads at once), in SGLang's input formats:
a single string (through the dynamic batch tokenizer), a batch of strings (one call),
cross-encoder pairs `[[query, doc], ...]` (one call, with token_type_ids), chat messages
(through the chat template), and decoding for /detokenize and logprob texts."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from api.batch_tokenizer import AsyncDynamicBatchTokenizer
from api.errors import BadRequest
from api.model import Tokenizer
from api.req_state import TextPair

T = TypeVar("T")

_MAX_CACHED_TOKEN_TEXTS = 200_000


@dataclass
class PairEncoding:
    input_ids: list[list[int]]
    token_type_ids: list[list[int]]


class TextTokenizer:
    def __init__(self, tokenizer: Tokenizer, *, batch_size: int, timeout_s: float) -> None:
        self.tokenizer = tokenizer
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        self.batcher = AsyncDynamicBatchTokenizer(
            self._encode_texts, self._executor, batch_size=batch_size, timeout_s=timeout_s
        )
        self._token_texts: dict[int, str] = {}

    async def close(self) -> None:
        await self.batcher.close()
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args))

    # -- encoding --------------------------------------------------------------------------
    async def encode_one(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """One string, batched with concurrent callers (SGLang's SINGLE_STRING)."""
        try:
            return await self.batcher.encode(text, add_special_tokens=add_special_tokens)
        except BadRequest:
            raise
        except Exception as e:
            raise _tokenize_error(e) from e

    async def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = True
    ) -> list[list[int]]:
        """A batch of strings in one tokenizer call (SGLang's BATCH_STRINGS)."""
        if len(texts) == 1:
            return [await self.encode_one(texts[0], add_special_tokens)]
        kwargs = {"add_special_tokens": add_special_tokens}
        return await self._run(self._encode_texts, list(texts), kwargs)

    def _encode_texts(self, texts: list[str], kwargs: dict[str, Any]) -> list[list[int]]:
        try:
            ids = self.tokenizer(texts, **kwargs)["input_ids"]
        except Exception as e:
            raise _tokenize_error(e) from e
        return [list(x) for x in ids]

    async def encode_pairs(
        self, pairs: Sequence[TextPair], add_special_tokens: bool = True
    ) -> PairEncoding:
        """Cross-encoder pairs in one call, with token_type_ids (CROSS_ENCODER_PAIRS)."""
        return await self._run(self._encode_pairs, list(pairs), add_special_tokens)

    def _encode_pairs(self, pairs: list[TextPair], add_special_tokens: bool) -> PairEncoding:
        try:
            out = self.tokenizer(
                [q for q, _ in pairs],
                [d for _, d in pairs],
                add_special_tokens=add_special_tokens,
                return_token_type_ids=True,
            )
        except Exception as e:
            raise _tokenize_error(e) from e
        ids = [list(x) for x in out["input_ids"]]
        types = out.get("token_type_ids") or [[0] * len(x) for x in ids]
        return PairEncoding(ids, [list(x) for x in types])

    async def render_chat(
        self, messages: list[dict[str, Any]], kwargs: dict[str, Any]
    ) -> list[int]:
        """Token ids of `messages` through the tokenizer's chat template."""
        return await self._run(self._render, messages, kwargs)

    def _render(self, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> list[int]:
        tokenizer = self.tokenizer
        try:
            prompt = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
            # The template already placed the special tokens (BOS and friends).
            return list(tokenizer.encode(str(prompt), add_special_tokens=False))
        except Exception as e:  # jinja errors ("roles must alternate", ...) are the client's
            raise BadRequest(f"Could not apply the chat template: {e}", param="messages") from e

    # -- decoding --------------------------------------------------------------------------
    async def decode_batch(
        self, batch: list[list[int]], skip_special_tokens: bool = True
    ) -> list[str]:
        return await self._run(self._decode_batch, batch, skip_special_tokens)

    def _decode_batch(self, batch: list[list[int]], skip_special_tokens: bool) -> list[str]:
        decode = self.tokenizer.decode
        return [str(decode(ids, skip_special_tokens=skip_special_tokens)) for ids in batch]

    async def ensure_token_texts(self, ids: Sequence[int]) -> None:
        """Decode (off the loop) the ids that `token_texts` does not know yet."""
        missing = {i for i in ids if i not in self._token_texts}
        if missing:
            texts = await self._run(self._decode_each, list(missing))
            if len(self._token_texts) + len(missing) > _MAX_CACHED_TOKEN_TEXTS:
                self._token_texts.clear()
            self._token_texts.update(zip(missing, texts, strict=True))

    def _decode_each(self, ids: list[int]) -> list[str]:
        """Each id's text alone; an id the tokenizer cannot decode (an engine bug) shows ""."""
        out = []
        for token_id in ids:
            try:
                out.append(str(self.tokenizer.decode([token_id])))
            except Exception:
                out.append("")
        return out

    def token_texts(self, ids: Sequence[int]) -> list[str]:
        """The text of each id on its own (logprob entries), from the cache that
        `ensure_token_texts` filled; an id it lacks is decoded here (rare)."""
        cache = self._token_texts
        return [cache[i] if i in cache else self._decode_one(i) for i in ids]

    def _decode_one(self, token_id: int) -> str:
        text = self._decode_each([token_id])[0]
        self._token_texts[token_id] = text
        return text


def _tokenize_error(e: Exception) -> BadRequest:
    return BadRequest(f"Could not tokenize the input: {type(e).__name__}")
