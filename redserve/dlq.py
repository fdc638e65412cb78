"""`redserve dlq list | retry RID | purge`: look at the jobs given up on and requeue them.

A job lands in the dead-letter stream after more than `scheduler.max_deliveries` deliveries
(each one a scheduler that died or stopped while running it); its client got an error then.
`retry` puts it back on the request stream with its output reset: the result can be read at
GET /v1/requests/{rid} once it finished (the original client is gone).
"""

from __future__ import annotations

import asyncio
import sys

from shared import request_stream
from shared.config import Settings
from shared.redis_conn import connect


def run(settings: Settings, action: str, rid: str | None) -> int:
    return asyncio.run(_run(settings, action, rid))


async def _run(settings: Settings, action: str, rid: str | None) -> int:
    if not settings.redis_url:
        sys.stderr.write("redserve dlq needs --redis-url (or REDSERVE_REDIS_URL)\n")
        return 2
    r, keys = connect(settings.redis_url, settings.redis_cluster), settings.redis_keys()
    try:
        if action == "list":
            for entry_id, info in await request_stream.dead_letters(r, keys):
                line = f"rid={info.get('rid')}  deliveries={info.get('deliveries')}"
                sys.stdout.write(f"{entry_id.decode()}  {line}  {info.get('reason')}\n")
            return 0
        if action == "purge":
            n = await request_stream.purge_dead_letters(r, keys)
            sys.stdout.write(f"purged {n} dead letters\n")
            return 0
        assert rid is not None
        if await request_stream.retry_dead_letter(r, keys, rid):
            sys.stdout.write(f"requeued {rid}\n")
            return 0
        sys.stderr.write(f"no dead letter for rid {rid}\n")
        return 1
    finally:
        await r.aclose()
