"""Real `python -m workers.detokenizer` processes on a real Redis, driven without a scheduler
or an api: `Traffic` publishes token steps as a scheduler does (id log + PUBLISH in one
transaction), `Collector` reads `out:{api_id}` as an api does."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import redis.asyncio as aioredis

from shared import protocol, request_state
from shared.config import DetokenizerSettings, Settings, child_process_env
from shared.keys import Keys
from shared.protocol import DetokParams, FinishReason, TextEntry, TokenEntry
from tests.support.detok_loop import publish_step


@dataclass
class Detokenizers:
    """Named detokenizer processes sharing one settings template; stopped by pid only."""

    settings: Settings
    log_dir: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def keys(self) -> Keys:
        return Keys(self.settings.key_prefix)

    def start(self, name: str, shards: list[int]) -> None:
        settings = self.settings.model_copy(deep=True)
        settings.detokenizer = DetokenizerSettings(
            worker_id=name, shards=shards, lease_ttl_s=self.settings.detokenizer.lease_ttl_s
        )
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 (the child keeps it)
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "workers.detokenizer"],
            env=child_process_env(settings), stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip

    def kill(self, name: str) -> None:
        """kill -9."""
        proc = self.procs[name]
        proc.kill()
        proc.wait()

    def stop(self, name: str, timeout_s: float = 10) -> int:
        """SIGTERM, then its exit code."""
        proc = self.procs[name]
        proc.send_signal(signal.SIGTERM)
        return proc.wait(timeout_s)

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted(self.log_dir.glob("*.log"))
        )


async def holders(r: aioredis.Redis, keys: Keys, num_shards: int) -> list[str | None]:
    """Who holds each shard's lease now."""
    values = await r.mget([keys.shard_lease(s) for s in range(num_shards)])
    return [v.decode() if v else None for v in values]


@dataclass
class Traffic:
    """Requests fed one id per step, as the scheduler streams them (epoch 1)."""

    r: aioredis.Redis
    keys: Keys
    num_shards: int
    api_id: str
    requests: dict[str, list[int]]
    sent: dict[str, int] = field(default_factory=dict)

    async def create(self) -> None:
        """The request states the api writes at submit."""
        pipe = self.r.pipeline()
        for rid in self.requests:
            request_state.create(pipe, self.keys, rid, self.api_id, prompt_tokens=3)
        await pipe.execute()

    async def step(self, finish: bool = False) -> None:
        """Each request's next id (with `finish`: all of its remaining ids, and the finish)."""
        entries = []
        for rid, ids in self.requests.items():
            seq = self.sent.get(rid, 0)
            end = len(ids) if finish else seq + 1
            if seq >= len(ids):
                continue
            done = FinishReason(type="length", length=len(ids)) if end >= len(ids) else None
            detok = DetokParams(api_id=self.api_id) if seq == 0 else None
            entries.append(TokenEntry(rid, 1, seq, ids[seq:end], 3, finish=done, detok=detok))
            self.sent[rid] = end
        await publish_step(self.r, self.keys, self.num_shards, entries)


class Collector:
    """Every TextEntry on `out:{api_id}`, read in the background."""

    def __init__(self, r: aioredis.Redis, keys: Keys, api_id: str) -> None:
        self.entries: list[TextEntry] = []
        self._pubsub = r.pubsub(ignore_subscribe_messages=True)
        self._channel = keys.output_channel(api_id)
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Collector:
        await self._pubsub.subscribe(self._channel)
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._pubsub.aclose()

    async def _run(self) -> None:
        while True:
            msg = await self._pubsub.get_message(timeout=0.1)
            if msg is not None:
                self.entries += protocol.decode(msg["data"], protocol.OutputMessage).entries

    def of(self, rid: str) -> list[TextEntry]:
        return [e for e in self.entries if e.rid == rid]

    def num_finished(self) -> int:
        return len({e.rid for e in self.entries if e.finish is not None})
