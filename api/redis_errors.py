"""What a failed Redis call means to a client: every api call to Redis is bounded by
REDIS_TIMEOUT_S (so a new request is answered within 2 s even by a hung Redis) and any
failure becomes a 503 saying why: unreachable, or full (`OOM command not allowed` under
`maxmemory` + `noeviction`)."""

from __future__ import annotations

from redis.exceptions import OutOfMemoryError, RedisError

from api.errors import ServiceUnavailable
from shared.redis_conn import REDIS_FAILURES

# A Redis round trip slower than this counts as "Redis unavailable": a request makes two of
# them (claim, submit) before it is answered.
REDIS_TIMEOUT_S = 0.9
REDIS_ERRORS: tuple[type[Exception], ...] = (*REDIS_FAILURES, TimeoutError)
OOM_MESSAGE = (
    "Redis is out of memory (maxmemory reached: OOM command not allowed); try again later."
)


def is_oom(exc: BaseException) -> bool:
    """Redis refused a write for maxmemory (redis-py's OutOfMemoryError drops the "OOM"
    prefix; inside MULTI it may come back as an EXECABORT that quotes it)."""
    if isinstance(exc, OutOfMemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RedisError) and (
        "OOM command not allowed" in text or "used memory > 'maxmemory'" in text
    )


def unavailable(exc: BaseException, message: str) -> ServiceUnavailable:
    """The 503 for a failed Redis call: the OOM reason when Redis is full, else `message`."""
    if is_oom(exc):
        return ServiceUnavailable(OOM_MESSAGE, code="redis_out_of_memory")
    return ServiceUnavailable(message, code="redis_unavailable")
