"""A live worker on a slow link that drops connections is never judged "process gone".

Issue 28: on a link with 50-200 ms of latency and dropped connections, a live worker was judged
"process gone" five times, each charging a ``worker_lost`` to its rollout's budget. Here its
Redis connections all go through a loopback proxy (``tests.link_proxy``) with that latency each
way, which drops its connections (all of them, or some) every 2-5 s; its watcher is another
worker on a direct connection. A dropped presence subscription takes 0.5-0.9 s to come back
over such a link (a reconnect is several round trips: connect, CLIENT SETNAME, CLIENT SETINFO,
SUBSCRIBE), longer than the 0.25 s confirmation it had, while the worker goes on renewing its
leases (2-3 s apart at worst: well within their 5 s TTL). Drops every 0.5-2 s are too much for
the leases themselves (renewals measured 6-7 s apart): the TTL takes such a worker over, by
design, which is not what this is about. Then the same worker is killed (-9) and is still
taken over because its process is gone, not when its leases expire.

In process, the rest of the rule: an absent worker that keeps renewing a lease is alive; an
absence is confirmed over ten of the round trips the worker registered, between 0.25 s (a dead
worker on a LAN is noticed as fast as before) and two heartbeats.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import numpy as np
import pytest
import redis.asyncio as aredis

from statemachine import RolloutRequest, Status
from store import defaults
from store.client import RolloutClient
from store.keys import Keys
from store.leases import Leases
from store.presence import Presence, PresenceWatch
from store.redis_server import RedisServer
from tests.link_proxy import LinkProxy
from tests.workers.helpers import (
    SYNTHETIC,
    direct_greedy,
    greedy,
    random_prompts,
    start_worker,
    until,
)
from tests.workers.helpers import stop as stop_procs
from tests.workers.test_fast_recovery import (
    GONE,
    UNPACED,
    generating_on,
    redis_up_for,
    registered,
    worker_lost,
)

pytestmark = pytest.mark.redis_server
KEYS = Keys()

ROLLOUTS = 3
TOKENS = 6000  # ~30 s each at the synthetic pace (5 ms a token): longer than the faults
FAULTS_S = 25.0


@pytest.mark.slow  # a worker scenario of ~35 s
async def test_a_live_worker_on_a_bad_link_keeps_its_rollouts(
    server: RedisServer, tmp_path: Path
) -> None:
    client = RolloutClient(server.url)
    await redis_up_for(client, defaults.PRESENCE_GRACE_S)
    proxy = LinkProxy(server.port, latency_s=(0.05, 0.2), seed=28)
    far_url = f"redis://127.0.0.1:{await proxy.start()}/0"
    prompts = random_prompts(ROLLOUTS, seed=28)
    ids = await client.submit(
        [RolloutRequest(prompt_token_ids=p, sampling=greedy(TOKENS)) for p in prompts]
    )
    far = start_worker(far_url, SYNTHETIC, "far", tmp_path / "far.log", concurrency=ROLLOUTS)
    near = None
    rng = random.Random(28)
    try:
        for rid in ids:
            await until(lambda rid=rid: generating_on(client, rid, "far"))  # type: ignore[misc]
        near = start_worker(server.url, SYNTHETIC, "near", tmp_path / "near.log",
                            concurrency=1, synthetic=UNPACED)  # fmt: skip
        await until(lambda: registered(client, "far", "near"))
        end = time.monotonic() + FAULTS_S
        while time.monotonic() < end:
            await asyncio.sleep(rng.uniform(2.0, 5.0))
            proxy.drop(1.0 if rng.random() < 0.5 else 0.5)  # a flap, or some connections
        assert proxy.dropped >= 10 and far.poll() is None
        # It registered round trips of this link: its absences are confirmed over 2 s.
        rtt_ms = int((await client.store.redis.hget(KEYS.presence(), "far")).split()[1])
        assert rtt_ms >= 100, rtt_ms
        for rid in ids:
            assert await worker_lost(client, rid) == [], (tmp_path / "near.log").read_text()
            assert await generating_on(client, rid, "far")
        # Its process dies: taken over because it is gone (not when its leases expire).
        far.kill()
        far.wait(10)
        killed = time.monotonic()
        await until(lambda: _all_taken_over(client, ids), timeout=30, every=0.02)
        noticed_s = time.monotonic() - killed
        results = await client.wait(ids, timeout=180)
    finally:
        stop_procs(far, *(p for p in [near] if p))
        await proxy.close()
    assert all(r.status is Status.DONE for r in results)
    for rid in ids:
        [lost] = await worker_lost(client, rid)
        assert lost.detail == GONE.format("far")
    # Well before the lease TTL (5 s) would have recovered them.
    assert noticed_s < defaults.LEASE_TTL_S - 1, noticed_s
    refs = await direct_greedy(None, SYNTHETIC, prompts, greedy(TOKENS))
    for r, (ref, _) in zip(results, refs, strict=True):
        np.testing.assert_array_equal(r.response_token_ids, ref)
    await client.aclose()


async def _all_taken_over(client: RolloutClient, ids: list[str]) -> bool:
    return all([await worker_lost(client, rid) != [] for rid in ids])


async def test_an_absent_worker_that_renews_its_leases_is_not_gone(
    server: RedisServer,
) -> None:
    """In process: a registered worker whose subscription is away (as while it reconnects) but
    whose heartbeat renews its lease is not gone, however long that lasts; once it stops
    renewing, it is gone after ``confirm_s``."""
    client = aredis.Redis.from_url(server.url)
    await client.hset(KEYS.presence(), "far", "1")  # registered; not subscribed now
    leases = Leases(client, holder="far")
    await leases.take("r1", 30.0)
    beating = asyncio.Event()
    beating.set()

    async def heartbeat() -> None:
        while beating.is_set():
            await leases.renew(["r1"], 30.0)
            await asyncio.sleep(0.3)

    beat = asyncio.create_task(heartbeat())
    watch = PresenceWatch(client, me="near", check_s=0.05, confirm_s=1.0, grace_s=0)
    try:
        for _ in range(3):
            await client.delete(KEYS.presence_check())
            assert await watch.gone() == []
        beating.clear()
        await beat
        await client.delete(KEYS.presence_check())
        t0 = time.monotonic()
        assert await watch.gone() == ["far"]
        assert time.monotonic() - t0 >= 1.0
    finally:
        beating.clear()
        await asyncio.wait([beat])
        await client.aclose()


async def test_an_absence_is_confirmed_over_ten_of_its_round_trips(server: RedisServer) -> None:
    """Each worker's window is 10 of the round trips it registered, within [0.25, 1.5] s here;
    a worker that registered none gets the longest. And a worker does register its own."""
    client = aredis.Redis.from_url(server.url)
    watch = PresenceWatch(client, me="near", check_s=0.05, confirm_s=1.5, grace_s=0,
                          confirm_min_s=0.25)  # fmt: skip
    try:
        for name, registered, low, high in [
            ("lan", f"{int(time.time() * 1000)} 1", 0.25, 0.6),  # 10 ms: the floor
            ("cross-zone", f"{int(time.time() * 1000)} 80", 0.8, 1.15),
            ("far", f"{int(time.time() * 1000)} 300", 1.5, 1.85),  # 3 s: the ceiling
            ("older", "1796282224414", 1.5, 1.85),  # a worker from before: the longest
        ]:
            await client.hset(KEYS.presence(), name, registered)  # not subscribed: absent
            await Leases(client, holder=name).take(f"r-{name}", 30.0)
            await client.delete(KEYS.presence_check())
            t0 = time.monotonic()
            assert await watch.gone() == [name]
            assert low <= time.monotonic() - t0 <= high, (name, time.monotonic() - t0)
            await client.delete(KEYS.presence())
        presence, stop = Presence(server.url, "me"), asyncio.Event()
        task = asyncio.create_task(presence.hold(stop))
        await asyncio.wait_for(presence.subscribed.wait(), 10)
        at, rtt = (await client.hget(KEYS.presence(), "me")).split()
        assert abs(int(at) - time.time() * 1000) < 5000 and 0 <= int(rtt) < 1000
        stop.set()
        await asyncio.wait_for(task, 10)
        await presence.close()
    finally:
        await client.aclose()


async def test_a_connection_dropped_as_the_link_turns_slow_is_not_a_death(
    server: RedisServer,
) -> None:
    """The soak's ``process_gone`` of its live slow-link worker (issue 28): the link turned slow
    while the worker's registered round trip was still a LAN's (it measures it when it
    registers, every 5 s), so its absences were confirmed over the 0.25 s floor; the link
    dropped its presence connection, and the resubscribe over the slow link (several round
    trips) outlasted that. Whatever the worker registered, a dropped connection is no death:
    its process holds another subscription, on a connection of its own, which only a death
    (or a flap of the whole link, confirmed over its round trips as before) takes too."""
    client = aredis.Redis.from_url(server.url)
    proxy = LinkProxy(server.port, latency_s=(0.0, 0.0), seed=28)
    url = f"redis://127.0.0.1:{await proxy.start()}/0"
    presence, stop = Presence(url, "far"), asyncio.Event()
    task = asyncio.create_task(presence.hold(stop))
    await Leases(client, holder="far").take("r-far", 30.0)  # checks run while leases exist
    watch = PresenceWatch(client, me="near", check_s=0.05, grace_s=0)  # the defaults' window
    try:
        await asyncio.wait_for(presence.subscribed.wait(), 10)
        at, rtt = (await client.hget(KEYS.presence(), "far")).split()
        assert watch._window(f"{int(at)} {int(rtt)}".encode()) == defaults.PRESENCE_CONFIRM_MIN_S
        # Every subscription held: what the worker holds, all registered on the clean link.
        held = await _subscription_ports(client)
        await until(lambda: _settled(client, held), timeout=10)
        proxy.latency_s = (0.05, 0.2)  # the link turns slow ...
        port = sorted(await _subscription_ports(client))[0]
        [link] = [k for k in proxy.links if k.server.get_extra_info("sockname")[1] == port]
        proxy.links.discard(link)
        link.close()  # ... and drops one of its subscriptions' connections
        await until(lambda: _gone_from_redis(client, port), timeout=5, every=0.005)
        await client.delete(KEYS.presence_check())
        assert await watch.gone() == []
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        await presence.close()
        await proxy.close()
        await client.aclose()


async def _subscription_ports(client: aredis.Redis) -> set[int]:
    """The source ports of the pub/sub clients Redis has (the proxy's upstream sockets)."""
    clients = await client.client_list(_type="pubsub")
    return {int(c["addr"].rsplit(":", 1)[1]) for c in clients}


async def _settled(client: aredis.Redis, before: set[int]) -> bool:
    await asyncio.sleep(0.3)
    return await _subscription_ports(client) == before


async def _gone_from_redis(client: aredis.Redis, port: int) -> bool:
    return port not in await _subscription_ports(client)
