"""Leases that lapsed while Redis refused writes are not taken from a live worker (issue 28's
soak: ``no_worker_lost_of_a_live_worker``), and those of a worker that really died then are
still taken over, later (real redis-server).

While Redis refuses writes (out of memory, a failed disk write) nobody can renew a lease, so a
lease that lapsed then says nothing about its worker. Each worker's reaper already held off
while its own worker saw the refusals (``StoreCondition.settling``); but a reaper whose worker
saw none (one started just after, or one that happened to write nothing then) reaped the
lapsed leases of live workers as soon as Redis accepted writes again, before their next
heartbeat renewed them, and charged each rollout a ``worker_lost``. Now the lease scripts
themselves, on Redis, see that writes were refused (Redis's own count of its refusals) and
count no lease as lapsed until a grace after the last refusal they saw: fleet-wide, whatever
each reaper's worker saw, and for the runner's check of a live holder too.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import redis.asyncio as aredis
from redis import Redis
from redis.exceptions import ResponseError

from statemachine import Aborted, AbortReason, Status, Submitted
from store import EventStore
from store.errors import unwritable
from store.leases import Leases
from store.redis_server import RedisServer
from tests import factories as f
from tests.unwritable import Switch, conditions, refusing, wait_accepting, wait_refusing
from workers.reaper import Reaper

pytestmark = pytest.mark.redis_server

TTL_S = 0.5  # the holder's lease
GRACE_S = 1.5  # the reapers' grace after the last refusal


@pytest_asyncio.fixture
async def client(server: RedisServer) -> AsyncIterator[aredis.Redis]:
    c = aredis.Redis.from_url(server.url)
    yield c
    await c.aclose()


@pytest.fixture(params=["oom", "misconf"])
def refusal(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Switch, Switch]:
    # READONLY is left out: making the server a replica replaces its data (the leases too).
    return conditions(tmp_path)[request.param]


async def _generating(store: EventStore, rid: str) -> None:
    """A rollout generating on worker "a" (attempt 1, some tokens saved)."""
    s = await store.append(
        None, Submitted(rollout_id=rid, seq=1, request=f.request(32), queue="rollouts")
    )
    s = await store.append(s, f.started(s, worker="a"))
    await store.append(s, f.tokens(s))


async def _lapse_while_refused(
    server: RedisServer, sync: Redis, holder: Leases, rid: str, refusal: tuple[Switch, Switch]
) -> None:
    """The holder's lease lapses while Redis refuses writes (its renewals refused), then
    Redis accepts writes again."""
    on, off = refusal
    await asyncio.to_thread(on, sync, server)
    await asyncio.to_thread(wait_refusing, sync)
    with pytest.raises(ResponseError) as refused:
        await holder.renew([rid], TTL_S)
    assert unwritable(refused.value) is not None
    await asyncio.sleep(TTL_S + 0.3)
    await asyncio.to_thread(off, sync, server)
    await asyncio.to_thread(wait_accepting, sync)
    assert not refusing(sync)


async def test_a_live_workers_lease_lapsed_while_redis_refused_writes_is_not_reaped(
    server: RedisServer, sync: Redis, client: aredis.Redis, refusal: tuple[Switch, Switch]
) -> None:
    store = EventStore(client)
    holder = Leases(client, store.keys, holder="a")
    # The reaper of a worker that saw none of the refusals: its own hold never holds.
    reaper = Reaper(store, Leases(client, store.keys, refusal_grace_s=GRACE_S), sync)
    await _generating(store, "r")
    await holder.take("r", TTL_S)
    assert await reaper.reap_once() == []  # it looks before the refusals, too

    await _lapse_while_refused(server, sync, holder, "r", refusal)

    # Right after: the lapsed lease is neither reaped nor seen lapsed by a worker given a
    # duplicate of the job (it would take the rollout over, charging a worker_lost too).
    assert await reaper.reap_once() == []
    assert ((await reaper.leases.read(["r"])).left_ms("r") or 0) > 0
    await holder.renew(["r"], 5.0)  # the holder's next heartbeat
    await asyncio.sleep(GRACE_S)
    assert await reaper.reap_once() == []
    state = await store.load("r")
    assert state.status is Status.GENERATING and state.attempt == 1 and state.worker_id == "a"
    assert not [e for e in await store.events("r") if isinstance(e, Aborted)]


async def test_a_lease_of_a_worker_that_died_while_redis_refused_writes_is_reaped_later(
    server: RedisServer, sync: Redis, client: aredis.Redis, refusal: tuple[Switch, Switch]
) -> None:
    store = EventStore(client)
    holder = Leases(client, store.keys, holder="a")
    reaper = Reaper(store, Leases(client, store.keys, refusal_grace_s=GRACE_S), sync)
    await _generating(store, "r")
    await holder.take("r", TTL_S)
    assert await reaper.reap_once() == []

    await _lapse_while_refused(server, sync, holder, "r", refusal)  # and "a" never renews

    assert await reaper.reap_once() == []  # within the grace
    await asyncio.sleep(GRACE_S)
    assert await reaper.reap_once() == ["r"]
    [lost] = [e for e in await store.events("r") if isinstance(e, Aborted)]
    assert lost.reason is AbortReason.WORKER_LOST
    assert (await reaper.leases.read(["r"])).left_ms("r") is None  # given back


async def test_without_refusals_a_lapsed_lease_is_reaped_at_once(
    sync: Redis, client: aredis.Redis
) -> None:
    """The grace costs nothing when Redis refused nothing: a dead worker's lease is reaped
    as soon as it lapses."""
    store = EventStore(client)
    holder = Leases(client, store.keys, holder="a")
    reaper = Reaper(store, Leases(client, store.keys, refusal_grace_s=GRACE_S), sync)
    await _generating(store, "r")
    await holder.take("r", TTL_S)
    assert await reaper.reap_once() == []
    await asyncio.sleep(TTL_S + 0.2)
    assert await reaper.reap_once() == ["r"]


async def _lapse_while_down(server: RedisServer, rid: str) -> None:
    """Redis is killed (its AOF keeps the leases), stays down until the holder's lease has
    lapsed, and comes back: nobody could renew meanwhile. A failover is the same to the lease
    scripts: the master that answers after it is another (a new replication id)."""
    await asyncio.to_thread(server.stop, kill=True)
    await asyncio.sleep(TTL_S + 0.3)
    await asyncio.to_thread(server.start)


async def test_a_live_workers_lease_lapsed_while_redis_was_down_is_not_reaped(
    server: RedisServer, sync: Redis, client: aredis.Redis
) -> None:
    """A restart (or a replica promoted in a failover) gives the same grace as refusals: the
    lease scripts see Redis's replication id change. Without it every lease of a fleet lapsed
    over an outage longer than the TTL is taken from its live worker the moment Redis is back
    (measured on a cluster: a lease of 4 s lapsed around a 2.4 s failover)."""
    store = EventStore(client)
    holder = Leases(client, store.keys, holder="a")
    reaper = Reaper(store, Leases(client, store.keys, refusal_grace_s=GRACE_S), sync)
    await _generating(store, "r")
    await holder.take("r", TTL_S)
    assert await reaper.reap_once() == []  # a pass before: what it saw is recorded

    await _lapse_while_down(server, "r")

    assert await reaper.reap_once() == []
    assert ((await reaper.leases.read(["r"])).left_ms("r") or 0) > 0
    await holder.renew(["r"], 5.0)  # the holder's first heartbeat once Redis is back
    await asyncio.sleep(GRACE_S)
    assert await reaper.reap_once() == []
    state = await store.load("r")
    assert state.status is Status.GENERATING and state.attempt == 1 and state.worker_id == "a"


async def test_a_lease_of_a_worker_that_died_while_redis_was_down_is_reaped_after_the_grace(
    server: RedisServer, sync: Redis, client: aredis.Redis
) -> None:
    store = EventStore(client)
    holder = Leases(client, store.keys, holder="a")
    reaper = Reaper(store, Leases(client, store.keys, refusal_grace_s=GRACE_S), sync)
    await _generating(store, "r")
    await holder.take("r", TTL_S)
    assert await reaper.reap_once() == []

    await _lapse_while_down(server, "r")  # and "a" never renews

    assert await reaper.reap_once() == []  # within the grace
    await asyncio.sleep(GRACE_S)
    assert await reaper.reap_once() == ["r"]
    [lost] = [e for e in await store.events("r") if isinstance(e, Aborted)]
    assert lost.reason is AbortReason.WORKER_LOST
