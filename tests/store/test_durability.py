"""On a real redis-server with AOF and fsync always: a restart, even by SIGKILL, loses no
acknowledged event, and writers that blindly retry after a lost reply never write twice."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.asyncio as aredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from statemachine import Event, RolloutState
from store import EventStore
from store.redis_server import RedisServer
from tests import factories as f

pytestmark = pytest.mark.redis_server


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of this test's own: it gets killed, so never the shared one."""
    data = tmp_path / "redis"
    data.mkdir()
    s = RedisServer(data).start()
    yield s
    s.close()


RETRIES: list[str] = []


async def append_retrying(
    store: EventStore, state: RolloutState | None, event: Event
) -> RolloutState:
    """Retry the very same append until Redis answers: safe only because appends are idempotent."""
    while True:
        try:
            return await store.append(state, event)
        except (RedisConnectionError, RedisTimeoutError, OSError):
            # Redis is down or restarting; the write may or may not have landed.
            RETRIES.append(event.rollout_id)
            await asyncio.sleep(0.05)


@pytest.mark.parametrize("kill", [False, True], ids=["sigterm", "sigkill"])
async def test_restart_loses_no_acknowledged_event(server: RedisServer, kill: bool) -> None:
    client = aredis.Redis.from_url(server.url)
    store = EventStore(client)
    acked: dict[str, RolloutState] = {}
    for i in range(20):
        s = await store.append(None, f.submitted(f"r{i}", max_tokens=100))
        s = await store.append(s, f.started(s))
        for _ in range(i % 5):
            s = await store.append(s, f.tokens(s, n=4, routes=True))
        acked[s.rollout_id] = s
    await client.aclose()

    server.restart(kill=kill)

    client = aredis.Redis.from_url(server.url)
    store = EventStore(client)
    for rid, expected in acked.items():
        assert await store.load(rid) == expected
        assert await store.replay(rid) == expected
    # The script cache died with the process: the first append reloads the script itself.
    s = acked["r3"]
    assert (await store.append(s, f.tokens(s, n=1))).num_tokens == s.num_tokens + 1
    await client.aclose()


async def test_writers_survive_sigkill_mid_stream_without_loss_or_duplicates(
    server: RedisServer,
) -> None:
    client = aredis.Redis.from_url(server.url, socket_timeout=2, socket_connect_timeout=0.5)
    store = EventStore(client)
    acked: dict[str, RolloutState] = {}
    max_chunks = 2000
    chaos_done = asyncio.Event()

    async def writer(rid: str) -> None:
        s = await append_retrying(store, None, f.submitted(rid, max_tokens=4 * max_chunks))
        s = await append_retrying(store, s, f.started(s))
        # Keep writing until the chaos is over (and a few chunks more), however slow the box.
        for n in range(max_chunks):
            if chaos_done.is_set() and n >= 20:
                break
            s = await append_retrying(store, s, f.tokens(s, n=4, routes=True))
            acked[rid] = s
            await asyncio.sleep(0.005)

    async def chaos() -> None:
        await asyncio.sleep(0.15)
        await asyncio.to_thread(server.restart, kill=True)
        await asyncio.sleep(0.15)
        await asyncio.to_thread(server.restart, kill=True)
        await asyncio.sleep(0.1)
        chaos_done.set()

    RETRIES.clear()
    await asyncio.gather(chaos(), *(writer(f"w{i}") for i in range(8)))
    assert len(set(RETRIES)) >= 4, "the kills did not interrupt the writers"
    await client.aclose()

    client = aredis.Redis.from_url(server.url)
    store = EventStore(client)
    for rid, last in acked.items():
        loaded = await store.load(rid)
        assert loaded == last == await store.replay(rid)
        events = await store.events(rid)
        offsets = [e.offset for e in events if hasattr(e, "offset")]
        assert offsets == list(range(0, loaded.num_tokens, 4))  # each offset exactly once
    await client.aclose()
