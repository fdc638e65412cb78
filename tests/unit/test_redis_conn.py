"""Commands packed by hiredis (shared/redis_conn.py) are byte for byte what redis-py's own
asyncio packer makes, for every kind of value the code sends; a value neither takes is
redis-py's DataError, as before."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from redis.asyncio.connection import Connection, UnixDomainSocketConnection
from redis.exceptions import DataError

from shared.redis_conn import connect, with_hiredis_packing

VALUES = st.one_of(
    st.binary(max_size=64),
    st.text(max_size=32),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False),
)


def _packed(conn: Any, *args: Any) -> bytes:
    return b"".join(bytes(part) for part in conn.pack_command(*args))


@given(st.sampled_from(["EVALSHA", "XADD", "CLIENT SETNAME"]), st.lists(VALUES, max_size=40))
def test_hiredis_packs_exactly_as_redis_py(command: str, values: list[Any]) -> None:
    ours, theirs = with_hiredis_packing(Connection)(), Connection()
    assert _packed(ours, command, *values) == _packed(theirs, command, *values)


def test_a_value_neither_takes_is_redis_pys_error() -> None:
    with pytest.raises(DataError):
        with_hiredis_packing(Connection)().pack_command("SET", "k", None)


def test_every_kind_of_connection_keeps_its_transport() -> None:
    assert issubclass(connect("redis://h:1/0").connection_pool.connection_class, Connection)
    unix = connect("unix:///tmp/redis.sock").connection_pool.connection_class
    assert issubclass(unix, UnixDomainSocketConnection)
