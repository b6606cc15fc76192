"""A task cancelled just before its next Redis command stops there (real redis-server).

Python 3.11's ``asyncio.timeout`` counts a cancel that was already pending when it was entered
as its own expiry, and its ``wait_for`` returns the inner result when that finished as the
cancel came. redis-py 7 polls every pooled connection under ``timeout(0)`` and writes every
command under ``wait_for``, so a cancel requested while the task ran synchronous code (a
Ctrl-C landing in the demo's loop, a worker's shutdown cancelling its loops) was swallowed and
the task ran on. ``store.connection`` gives its clients connections that keep it.
"""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aredis

from store import connection
from store.redis_server import RedisServer


async def _cancelled_then(step) -> str:  # type: ignore[no-untyped-def]
    """Run ``step()`` in a task that was cancelled just before it: what became of it."""

    async def body() -> str:
        task = asyncio.current_task()
        assert task is not None
        task.cancel()  # pending, as when a signal handler cancels the running task
        await step()
        return "ran on"

    try:
        return await asyncio.create_task(body())
    except asyncio.CancelledError:
        return "cancelled"


@pytest.fixture
async def client(redis_server: RedisServer):  # type: ignore[no-untyped-def]
    client = connection.connect(redis_server.url)
    await client.ping()  # a pooled connection to check out again, as in any long run
    yield client
    await client.aclose()


async def test_a_pending_cancel_stops_the_next_command(client: aredis.Redis) -> None:
    assert await _cancelled_then(client.ping) == "cancelled"
    # The client is still good for the next caller.
    assert await client.ping() is True


async def test_a_pending_cancel_stops_a_pipeline_and_a_script(client: aredis.Redis) -> None:
    async def pipeline() -> None:
        async with client.pipeline(transaction=True) as pipe:
            await pipe.incr("p").incr("p").execute()

    async def script() -> None:
        await client.eval("return redis.call('INCR', KEYS[1])", 1, "s")

    assert await _cancelled_then(pipeline) == "cancelled"
    assert await _cancelled_then(script) == "cancelled"
    # Sent before the cancel landed (the write does not wait) or not at all; never in part.
    assert await client.get("p") in (None, b"2")
    assert await client.get("s") in (None, b"1")
    assert await client.ping() is True


async def test_a_pending_cancel_stops_a_write_on_a_bare_connection(
    client: aredis.Redis,
) -> None:
    # The write path alone (redis-py's wait_for), without the pool's check before it.
    conn = client.connection_pool.make_connection()
    await conn.connect()
    try:
        assert await _cancelled_then(lambda: conn.send_command("PING")) == "cancelled"
    finally:
        await conn.disconnect()


async def test_a_connection_with_unread_data_is_still_replaced(client: aredis.Redis) -> None:
    # What the pool's check is for: a reply nobody read (a caller cancelled mid-command)
    # must not be taken as the next caller's reply.
    pool = client.connection_pool
    conn = await pool.get_connection()
    await conn.send_command("ECHO", "stale")
    for _ in range(200):
        if await conn.can_read_destructive():
            break
        await asyncio.sleep(0.01)
    else:
        pytest.fail("the stale reply never showed as readable")
    await pool.release(conn)
    assert await client.echo("fresh") == b"fresh"


async def test_a_connection_closed_by_the_server_is_replaced(
    client: aredis.Redis, redis_server: RedisServer
) -> None:
    ident = await client.client_id()  # the one pooled connection's
    admin = aredis.Redis.from_url(redis_server.url)
    try:
        assert await admin.client_kill_filter(_id=ident) == 1
    finally:
        await admin.aclose()
    await asyncio.sleep(0.05)  # the close reaches our side of the socket
    assert await client.ping() is True
    assert await client.client_id() != ident
