"""The reaper on fakeredis and on a real redis-server: each bad rollout affects only itself,
and work goes back to the queue it was submitted to."""

from __future__ import annotations

from collections.abc import AsyncIterator

import fakeredis
import pytest
import redis
import redis.asyncio as aredis
from rq import Queue

from statemachine import Aborted, AbortReason, Status, Submitted
from store import EventStore
from store.event_store import HEAD
from store.leases import Leases, now_ms
from store.queue import rollout_queue
from store.redis_server import RedisServer
from tests import factories as f
from tests.damage import damage_event
from workers.reaper import Reaper


@pytest.fixture(params=["fakeredis", "redis-server"])
async def clients(
    request: pytest.FixtureRequest,
) -> AsyncIterator[tuple[aredis.Redis, redis.Redis]]:
    """An asyncio client and a sync one (rq's) on the same data."""
    if request.param == "fakeredis":
        server = fakeredis.FakeServer()
        a, s = fakeredis.FakeAsyncRedis(server=server), fakeredis.FakeRedis(server=server)
    else:
        real: RedisServer = request.getfixturevalue("redis_server")
        a, s = aredis.Redis.from_url(real.url), redis.Redis.from_url(real.url)
        await a.flushall()
    yield a, s
    await a.aclose()
    s.close()


async def _live(store: EventStore, rid: str, queue: str = "rollouts") -> None:
    """A rollout generating on worker "dead" (attempt 1, some tokens saved)."""
    s = await store.append(
        None, Submitted(rollout_id=rid, seq=1, request=f.request(32), queue=queue)
    )
    s = await store.append(s, f.started(s, worker="dead"))
    await store.append(s, f.tokens(s))


def _job_ids(queue: Queue) -> list[str]:
    return [str(queue.fetch_job(j).kwargs["rollout_id"]) for j in queue.job_ids]  # type: ignore[union-attr]


async def test_expired_lease_goes_back_to_the_rollouts_own_queue(clients) -> None:  # type: ignore[no-untyped-def]
    a, s = clients
    store, leases = EventStore(a), Leases(a)
    await _live(store, "for-qk", queue="qk")
    await leases.redis.zadd(leases.key, {"for-qk": now_ms() - 1000})
    # The reaping worker serves another queue: before, it requeued the rollout there, and so
    # resumed it on another model.
    reaper = Reaper(store, leases, s)
    assert await reaper.reap_once() == ["for-qk"]
    assert _job_ids(rollout_queue(s, "qk")) == ["for-qk"]
    assert rollout_queue(s, "rollouts").count == 0
    state = await store.load("for-qk")
    assert state.status is Status.ABORTED and state.abort_reason is AbortReason.WORKER_LOST


async def test_one_unreadable_rollout_is_quarantined_and_the_rest_recovered(clients) -> None:  # type: ignore[no-untyped-def]
    a, s = clients
    store, leases = EventStore(a), Leases(a)
    for rid in ("bad", "bad-head", "good"):
        await _live(store, rid)
    # "bad": a damaged token record (its snapshot is fine); "bad-head": a damaged snapshot.
    await damage_event(a, store, "bad", 3)
    await a.hset(store.keys.snapshot("bad-head"), HEAD, b"S\x00\x00\x00\x00garbage")
    # Oldest first: before, the first unreadable lease stopped every pass right there.
    t = now_ms()
    await a.zadd(leases.key, {"bad": t - 3000, "bad-head": t - 2000, "good": t - 1000})
    reaper = Reaper(store, leases, s)
    assert await reaper.reap_once() == ["good"]
    assert (await store.load("good")).status is Status.ABORTED
    quarantined = await leases.quarantined()
    assert set(quarantined) == {"bad", "bad-head"}
    assert "checksum" in quarantined["bad"]
    assert await a.zcard(leases.key) == 0  # nothing left to trip over next pass
    # Where the snapshot is readable the rollout ends, so a trainer waiting for it stops.
    assert await store.statuses(["bad"]) == [Status.FAILED]
    assert await reaper.reap_once() == []  # and a second pass has nothing to do
    assert reaper.quarantined == 2


async def test_a_transient_error_on_one_lease_does_not_stop_the_others(  # type: ignore[no-untyped-def]
    clients, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, s = clients
    store, leases = EventStore(a), Leases(a)
    for rid in ("flaky", "good"):
        await _live(store, rid)
    t = now_ms()
    await a.zadd(leases.key, {"flaky": t - 2000, "good": t - 1000})
    real_load = store.load

    async def load(rid: str):  # type: ignore[no-untyped-def]
        if rid == "flaky":
            raise redis.exceptions.ConnectionError("connection reset")
        return await real_load(rid)

    monkeypatch.setattr(store, "load", load)
    reaper = Reaper(store, leases, s)
    assert await reaper.reap_once() == ["good"]
    assert await leases.expiry("flaky") is not None  # still there: retried next pass
    monkeypatch.setattr(store, "load", real_load)
    assert await reaper.reap_once() == ["flaky"]
    events = await store.events("flaky")
    assert isinstance(events[-1], Aborted)
