"""SGLang's async dynamic batch tokenizer: concurrent single-text encodes share one tokenizer
call. A loop takes the first queued text; only when more are already waiting does it keep
collecting, up to `batch_size` texts or `timeout_s`. Texts with identical keyword arguments
go to the tokenizer in one call; the call runs on the caller's executor (one thread), so the
event loop never tokenizes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

# Encodes a list of texts with the given keyword arguments: one id list per text.
BatchEncode = Callable[[list[str], dict[str, Any]], list[list[int]]]


@dataclass
class _Item:
    text: str
    kwargs: dict[str, Any]
    future: asyncio.Future[list[int]] = field(repr=False)


class AsyncDynamicBatchTokenizer:
    def __init__(
        self,
        encode_batch: BatchEncode,
        executor: Executor,
        *,
        batch_size: int = 32,
        timeout_s: float = 0.002,
    ) -> None:
        self._encode_batch = encode_batch
        self._executor = executor
        self.batch_size = max(1, batch_size)
        self.timeout_s = timeout_s
        self._queue: asyncio.Queue[_Item] | None = None
        self._task: asyncio.Task[None] | None = None
        self.num_calls = 0  # tokenizer calls made (for stats and tests)

    async def encode(self, text: str, **kwargs: Any) -> list[int]:
        """The ids of `text`, from a tokenizer call shared with concurrent callers."""
        if self._queue is None:
            self._queue = asyncio.Queue()
            self._task = asyncio.create_task(self._run(self._queue), name="batch-tokenizer")
        future: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(_Item(text, kwargs, future))
        return await future

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._queue is not None:
            while not self._queue.empty():
                self._queue.get_nowait().future.cancel()
            self._queue = None

    async def _run(self, queue: asyncio.Queue[_Item]) -> None:
        while True:
            batch = await self._gather(queue)
            try:
                await self._process(batch)
            except asyncio.CancelledError:
                for item in batch:
                    item.future.cancel()
                raise

    async def _gather(self, queue: asyncio.Queue[_Item]) -> list[_Item]:
        batch = [await queue.get()]
        if queue.empty():
            return batch  # nobody else is waiting: do not delay a lone request
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        while len(batch) < self.batch_size:
            if not queue.empty():
                batch.append(queue.get_nowait())
                continue
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                break
            try:
                batch.append(await asyncio.wait_for(queue.get(), remaining))
            except TimeoutError:
                break
        return batch

    async def _process(self, batch: list[_Item]) -> None:
        live = [item for item in batch if not item.future.done()]
        groups: dict[str, list[_Item]] = {}
        for item in live:
            groups.setdefault(repr(sorted(item.kwargs.items())), []).append(item)
        for items in groups.values():
            await self._encode_group(items)

    async def _encode_group(self, items: list[_Item]) -> None:
        loop = asyncio.get_running_loop()
        texts = [item.text for item in items]
        self.num_calls += 1
        try:
            ids = await loop.run_in_executor(
                self._executor, self._encode_batch, texts, items[0].kwargs
            )
        except Exception as e:
            if len(items) > 1:  # one bad text must not fail the others: retry one by one
                for item in items:
                    await self._encode_group([item])
            elif not items[0].future.done():
                items[0].future.set_exception(e)
            return
        for item, item_ids in zip(items, ids, strict=True):
            if not item.future.done():
                item.future.set_result(item_ids)
