"""The file store of the OpenAI Files API, shared by the api and jobs tiers: each file's
content in one directory (`Settings.files_path()`, a volume both tiers mount), its record in
Redis (`file:{id}` hash, listed by creation time in `files`).

Content is written to `{id}.part` and renamed into place before its record exists, so a record
always names a whole file; a `.part` left by a crash is swept by the maintenance job."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import msgspec
import redis.asyncio as aioredis

from shared.keys import Keys
from shared.redis_conn import atomic

PART_SUFFIX = ".part"
_PAGE = 100  # records read per round trip when listing


class FileRecord(msgspec.Struct, omit_defaults=False):
    """OpenAI's File object, as stored (every field a string in the hash)."""

    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    expires_at: int | None = None
    object: str = "file"
    status: str = "processed"
    status_details: str | None = None

    def to_api(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self)

    def to_hash(self) -> dict[str, str]:
        return {k: msgspec.json.encode(v).decode() for k, v in msgspec.structs.asdict(self).items()}

    @classmethod
    def from_hash(cls, stored: dict[Any, Any]) -> FileRecord:
        fields = {_text(k): msgspec.json.decode(_text(v)) for k, v in stored.items()}
        return msgspec.convert(fields, cls)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


class FileStore:
    """Records in Redis, content under `root`. No I/O in the constructor."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, root: Path) -> None:
        self.redis = redis
        self.keys = keys
        self.root = root

    def path(self, file_id: str) -> Path:
        return self.root / file_id

    def part_path(self, file_id: str) -> Path:
        return self.root / f"{file_id}{PART_SUFFIX}"

    async def add(
        self,
        file_id: str,
        filename: str,
        purpose: str,
        expires_after_s: int | None = None,
    ) -> FileRecord:
        """Publish `{file_id}.part` (written completely) as a file: rename, then record.
        It expires `expires_after_s` after its creation (OpenAI's anchor `created_at`)."""
        part, final = self.part_path(file_id), self.path(file_id)
        size = await asyncio.to_thread(_publish, part, final)
        created_at = int(time.time())
        expires_at = None if expires_after_s is None else created_at + expires_after_s
        record = FileRecord(file_id, size, created_at, filename, purpose, expires_at)
        async with atomic(self.redis) as pipe:
            pipe.hset(self.keys.file(file_id), mapping=record.to_hash())
            # Listed by the time to the microsecond: created_at (seconds) ties within a second.
            pipe.zadd(self.keys.files, {file_id: time.time()})
            await pipe.execute()
        return record

    async def fill(self, file_id: str, fill: Callable[[IO[bytes]], None]) -> None:
        """Write `{file_id}.part` with `fill` (in a thread), for `add` to publish."""

        def write() -> None:
            self.root.mkdir(parents=True, exist_ok=True)
            with open(self.part_path(file_id), "wb") as out:
                fill(out)

        await asyncio.to_thread(write)

    async def get(self, file_id: str) -> FileRecord | None:
        stored = await self.redis.hgetall(self.keys.file(file_id))  # type: ignore[misc]
        return FileRecord.from_hash(stored) if stored else None

    async def page(
        self, *, after: str | None, limit: int, descending: bool, purpose: str | None
    ) -> tuple[list[FileRecord], bool]:
        """One page (OpenAI's cursor pagination: the files after `after` in this order),
        and whether there are more."""
        ids = [_text(i) for i in await self.redis.zrange(self.keys.files, 0, -1, desc=descending)]
        if after is not None:
            ids = ids[ids.index(after) + 1 :] if after in ids else []
        page: list[FileRecord] = []
        for start in range(0, len(ids), _PAGE):
            for record in await self._get_many(ids[start : start + _PAGE]):
                if purpose and record.purpose != purpose:
                    continue
                if len(page) == limit:
                    return page, True
                page.append(record)
        return page, False

    async def _get_many(self, file_ids: list[str]) -> list[FileRecord]:
        async with self.redis.pipeline(transaction=False) as pipe:
            for file_id in file_ids:
                pipe.hgetall(self.keys.file(file_id))
            stored = await pipe.execute()
        return [FileRecord.from_hash(s) for s in stored if s]

    async def delete(self, file_id: str) -> bool:
        """Drop the record, then the content; False if there was no such file."""
        async with atomic(self.redis) as pipe:
            pipe.delete(self.keys.file(file_id))
            pipe.zrem(self.keys.files, file_id)
            deleted, _ = await pipe.execute()
        await asyncio.to_thread(self.path(file_id).unlink, missing_ok=True)
        return bool(deleted)

    async def discard_part(self, file_id: str) -> None:
        """Best effort: a part that cannot be removed is left to the maintenance sweep."""
        with contextlib.suppress(OSError):
            await asyncio.to_thread(self.part_path(file_id).unlink, missing_ok=True)

    async def discard(self, file_id: str) -> None:
        """Best effort: the content of a file `add` could not record (Redis away)."""
        await self.discard_part(file_id)
        with contextlib.suppress(OSError):
            await asyncio.to_thread(self.path(file_id).unlink, missing_ok=True)


def _publish(part: Path, final: Path) -> int:
    """Rename the part into place (synced first); a part renamed already stays as it is."""
    if part.exists() or not final.exists():
        with open(part, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(part, final)
    return final.stat().st_size
