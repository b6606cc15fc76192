"""One clock judges leases and heartbeats: Redis's (issue 28, point 2).

Each test moves this host's wall clock (``host_clock``: ``time.time``) away from Redis's by more
than a lease TTL, as a host without NTP (or stepped by it) is, and checks that taking, renewing,
reaping, the stats' live workers, the presence registry and the operator's figures do not
change. Before, each of them read the host's clock: a lease taken 10 s behind was expired on
arrival, a reaper 10 s ahead took live leases back, and a renewal from behind was refused
(``ZADD GT``). On fakeredis and on a real redis-server (whose TIME no patch reaches).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
import redis.asyncio as aredis
from redis import Redis

from store import EventStore
from store.client import RolloutClient
from store.inspect import cluster_status, rollouts_now
from store.leases import Leases
from store.presence import Presence
from store.redis_server import RedisServer
from store.stats import WorkerBeat, beat, prune, read_stats
from tests import factories as f
from tests.store.trainer import start

TTL = 5.0  # the default lease TTL
SKEW = 10.0  # seconds: twice the TTL

Clock = Callable[[float], None]


@pytest.fixture
def leases(redis_client: aredis.Redis) -> Leases:
    return Leases(redis_client)


async def redis_ms(client: aredis.Redis) -> int:
    seconds, micros = await client.time()
    return seconds * 1000 + micros // 1000


@pytest.mark.parametrize("skew", [-SKEW, SKEW])
async def test_a_lease_taken_on_a_skewed_host_lasts_its_ttl_by_redis_clock(
    leases: Leases, host_clock: Clock, skew: float
) -> None:
    host_clock(skew)
    before = await redis_ms(leases.redis)
    await leases.take("r1", TTL)
    expiry = await leases.expiry("r1")
    assert expiry is not None and before + 5_000 <= expiry <= await redis_ms(leases.redis) + 5_000
    host_clock(0)  # a reaper on a true clock: the lease is live
    assert await leases.expired() == []
    left = await leases.left_ms("r1")
    assert left is not None and 4_000 < left <= 5_000


@pytest.mark.parametrize("skew", [-SKEW, SKEW])
async def test_a_reaper_on_a_skewed_host_takes_back_exactly_the_expired_leases(
    leases: Leases, host_clock: Clock, skew: float
) -> None:
    await leases.take("live", TTL)
    await leases.take("lapsed", -1.0)  # expired a second ago, by Redis's clock
    host_clock(skew)
    assert [rid for rid, _ in await leases.expired()] == ["lapsed"]
    view = await leases.read(["live", "lapsed", "none"])
    assert (view.held, view.expired) == (2, 1)
    live, lapsed = view.left_ms("live"), view.left_ms("lapsed")
    assert live is not None and live > 4_000
    assert lapsed is not None and -2_000 < lapsed <= -1_000
    assert view.left_ms("none") is None


async def test_a_host_behind_renews_and_never_resurrects(leases: Leases, host_clock: Clock) -> None:
    await leases.take("held", TTL)
    first = await leases.expiry("held")
    await asyncio.sleep(0.05)
    host_clock(-SKEW)  # before: GT refused every renewal until the clock caught up 10 s later
    now = await leases.renew(["held", "reaped"], TTL)
    renewed = await leases.expiry("held")
    assert first is not None and renewed is not None and renewed > first
    assert renewed == now + 5_000  # stamped by the clock the script read
    assert await leases.expiry("reaped") is None  # XX, as ever
    assert abs(now - await redis_ms(leases.redis)) < 1_000  # Redis's clock, not this host's


async def test_a_release_loses_to_a_renewal_from_a_host_behind(
    leases: Leases, host_clock: Clock
) -> None:
    await leases.take("woke", -1.0)
    [(rid, seen)] = await leases.expired()  # a reaper saw it expired ...
    host_clock(-SKEW)
    await leases.renew([rid], TTL)  # ... and its worker, 10 s behind, renewed meanwhile
    assert not await leases.release_if_unchanged(rid, seen)
    assert not await leases.quarantine(rid, seen, "renewed meanwhile")
    assert await leases.expired() == []


async def test_live_workers_are_judged_by_redis_clock(
    redis_client: aredis.Redis, host_clock: Clock
) -> None:
    keys = EventStore(redis_client).keys
    # A worker stamps its beat with Redis's clock (what its lease renewal returns).
    at = await redis_ms(redis_client) / 1000
    await beat(redis_client, keys, WorkerBeat("w1", 1, 0, ("rollouts",), "m", at=at))
    host_clock(20.0)  # a reader (or a reaper's prune) 20 s ahead: beyond WORKER_STALE_S (15)
    stats = await read_stats(redis_client, keys)
    assert [w.worker_id for w in stats.workers] == ["w1"]
    assert abs(stats.now - at) < 1.0 and 0 <= stats.workers[0].age_s(stats.now) < 1.0
    assert await prune(redis_client, keys) == []
    assert await redis_client.hexists(keys.workers(), "w1")


async def test_the_presence_registry_is_stamped_by_redis_clock(
    redis_server: RedisServer, real_redis: aredis.Redis, host_clock: Clock
) -> None:
    host_clock(3600.0)
    presence, stop = Presence(redis_server.url, "w1"), asyncio.Event()
    held = asyncio.create_task(presence.hold(stop))
    try:
        await asyncio.wait_for(presence.subscribed.wait(), 10)
        # "<when, by Redis's clock, ms> <the worker's round trip, ms>"
        value = await real_redis.hget(presence.keys.presence(), "w1")  # type: ignore[misc]
        stamp, round_trip = (int(v) for v in value.split())
        assert abs(stamp - await redis_ms(real_redis)) < 2_000
        assert 0 <= round_trip < 2_000
    finally:
        stop.set()
        await asyncio.wait_for(held, 10)
        await presence.close()


async def test_the_operators_figures_are_judged_by_redis_clock(
    redis_server: RedisServer, real_redis: aredis.Redis, host_clock: Clock
) -> None:
    client = RolloutClient(redis_server.url)
    store, leases = client.store, Leases(real_redis)
    for rid in ("live", "lapsed"):
        await store.append(None, f.submitted(rid, max_tokens=8))
        await start(store, rid, "w")
    await leases.take("live", TTL)
    await leases.take("lapsed", -1.0)
    at = await redis_ms(real_redis) / 1000
    await beat(real_redis, store.keys, WorkerBeat("w", 2, 0, ("rollouts",), "m", at=at))
    sync = Redis.from_url(redis_server.url)
    try:
        for skew in (-SKEW, SKEW):
            host_clock(skew)
            status = await cluster_status(client)
            assert (status.leases, status.expired_leases) == (2, 1)
            [w] = status.workers
            assert w.heartbeat_age_s < 2.0
            live, lapsed = await rollouts_now(store, sync, ["live", "lapsed"])
            live_left, lapsed_left = live.lease_left_s(), lapsed.lease_left_s()
            assert live_left is not None and 4.0 < live_left <= 5.0
            assert lapsed_left is not None and lapsed_left <= -1.0
    finally:
        sync.close()
        await client.aclose()


def test_host_clock_moves_this_host_only(host_clock: Clock) -> None:
    """The fixture itself: time.time moves, fakeredis's TIME does not."""
    import fakeredis

    server = fakeredis.FakeRedis()
    host_clock(SKEW)
    seconds, _ = server.time()
    assert abs(time.time() - SKEW - seconds) < 2
