"""A dead worker process is noticed when its Redis connections close, not when its leases expire.

In-process tests drive ``store.presence`` and the reaper against a real redis-server; process
tests run real workers (the paced synthetic engine) and assert how each takeover was decided,
from the abort it recorded (``Aborted.detail``) and the reaper's log line, never from a clock:
- kill -9: taken over because the process was gone;
- SIGSTOP: taken over because the lease expired (its connections stayed open), and the stalled
  worker stays fenced out when it continues;
- a worker whose event loop stalls for 1.5 s at a time keeps its rollouts, and is still taken
  over at once when it is then killed (so the watch was running all along);
- a Redis restart, with one worker unable to reconnect for 2 s, takes nothing over.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
import redis
import redis.asyncio as aredis

from statemachine import Aborted, AbortReason, RolloutRequest, Status, Submitted, TokensAppended
from store import EventStore, defaults
from store.client import RolloutClient
from store.keys import Keys
from store.leases import Leases
from store.presence import SUBSCRIPTIONS, Presence, PresenceWatch
from store.queue import rollout_queue
from store.redis_server import RedisServer
from tests import factories as f
from tests.workers.helpers import (
    SYNTHETIC,
    direct_greedy,
    greedy,
    random_prompts,
    start_worker,
    until,
)
from tests.workers.helpers import stop as stop_procs
from workers.reaper import Reaper

pytestmark = pytest.mark.redis_server

KEYS = Keys()
UNPACED = {"token_delay_s": 0.0}  # a rescuer's pace matters to nothing tested
GONE = "process of {} gone (its Redis connections closed)"
EXPIRED = "lease of {} expired"


@pytest.fixture
async def client(server: RedisServer) -> AsyncIterator[aredis.Redis]:
    c = aredis.Redis.from_url(server.url)
    yield c
    await c.aclose()


def watch(client: aredis.Redis, *, grace_s: float = 0.0) -> PresenceWatch:
    """A watch that, with ``grace_s`` 0, judges however young the server is."""
    return PresenceWatch(client, me="reaper", check_s=0.001, confirm_s=0.2, grace_s=grace_s)


async def check(client: aredis.Redis, *, grace_s: float = 0.0) -> list[str]:
    """One check, as the reaper that won this interval's token."""
    await client.delete(KEYS.presence_check())
    return await watch(client, grace_s=grace_s).gone()


async def hold(url: str, worker: str) -> tuple[Presence, asyncio.Task[None], asyncio.Event]:
    presence, stop = Presence(url, worker), asyncio.Event()
    task = asyncio.create_task(presence.hold(stop))
    await asyncio.wait_for(presence.subscribed.wait(), 10)
    return presence, task, stop


async def die(presence: Presence, task: asyncio.Task[None]) -> None:
    """What a kill does to a worker's presence: the connection closes, nothing unregisters."""
    task.cancel()
    await asyncio.wait([task])
    for c in presence.clients:
        await c.aclose()


async def _live(store: EventStore, leases: Leases, rid: str, worker: str) -> None:
    """A rollout generating on ``worker``, leased through ``leases``."""
    s = await store.append(None, Submitted(rollout_id=rid, seq=1, request=f.request(32)))
    await leases.take(rid, 30.0)
    s = await store.append(s, f.started(s, worker=worker))
    await store.append(s, f.tokens(s))


async def test_a_closed_connection_is_gone_a_live_one_is_not(
    server: RedisServer, client: aredis.Redis
) -> None:
    alive, alive_task, alive_stop = await hold(server.url, "alive")
    dead, dead_task, _ = await hold(server.url, "dead")
    await client.zadd(KEYS.leases(), {"some-rollout": 1})  # the check runs only with leases
    try:
        assert set(await client.hkeys(KEYS.presence())) == {b"alive", b"dead"}
        assert await check(client) == []
        await die(dead, dead_task)
        assert await check(client) == ["dead"]
        # Within the grace after a (re)start nobody is judged: all are reconnecting.
        assert await check(client, grace_s=3600) == []
        # Redis drops the live worker's connection: it resubscribes before the confirmation.
        assert await client.client_kill_filter(_type="pubsub") >= 1
        assert await check(client) == ["dead"]
        await until(lambda: _subscribers(client, "alive", SUBSCRIPTIONS), timeout=10)
        # Another reaper won this interval's token: this one does not check.
        await client.delete(KEYS.presence_check())
        w = PresenceWatch(client, me="reaper", check_s=60, confirm_s=0.2, grace_s=0)
        assert await w.gone() == ["dead"]
        assert await w.gone() == [] and w.checks == 1
    finally:
        alive_stop.set()
        await asyncio.wait_for(alive_task, 10)
        await alive.close()
    # A worker that stops with no lease left unregisters; nobody need look for it.
    assert await client.hkeys(KEYS.presence()) == [b"dead"]


async def _subscribers(client: aredis.Redis, worker: str, n: int) -> bool:
    [(_, count)] = await client.pubsub_numsub(KEYS.presence_channel(worker))
    return int(count) == n


async def test_no_presence_check_without_leases(server: RedisServer, client: aredis.Redis) -> None:
    await client.hset(KEYS.presence(), "dead", "1")  # registered, never subscribed
    w = watch(client)
    assert await w.gone() == [] and w.checks == 1
    await client.zadd(KEYS.leases(), {"r": 1})
    assert await check(client) == ["dead"]


async def test_acl_refusal_turns_the_watch_off_with_one_warning(
    server: RedisServer, client: aredis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    await client.acl_setuser(
        "limited", enabled=True, passwords=["+pw"], keys=["*"], channels=["*"],
        commands=["+@all", "-pubsub", "-info"],
    )  # fmt: skip
    await client.hset(KEYS.presence(), "dead", "1")
    await client.zadd(KEYS.leases(), {"r": 1})
    limited = aredis.Redis(host="127.0.0.1", port=server.port, username="limited", password="pw")
    try:
        w = watch(limited)
        with caplog.at_level(logging.WARNING, logger="rollouts.presence"):
            assert await w.gone() == []
            assert await w.gone() == []
        assert w.off is not None and "NOPERM" in w.off.upper()
        assert len([r for r in caplog.records if "presence" in r.getMessage()]) == 1
    finally:
        await limited.aclose()
    # A worker that may not subscribe is never registered, so never judged gone.
    await client.acl_setuser("nosub", enabled=True, passwords=["+pw"], keys=["*"],
                             commands=["+@all", "-subscribe"])  # fmt: skip
    url = f"redis://nosub:pw@127.0.0.1:{server.port}/0"
    presence, stop = Presence(url, "nosub-worker"), asyncio.Event()
    await asyncio.wait_for(presence.hold(stop), 10)
    assert presence.refused is not None
    assert await client.hkeys(KEYS.presence()) == [b"dead"]
    await presence.close()


async def test_reaper_takes_back_only_the_gone_workers_live_attempts(
    server: RedisServer, client: aredis.Redis
) -> None:
    store = EventStore(client)
    mine, other = Leases(client, holder="w-dead"), Leases(client, holder="w-other")
    await _live(store, mine, "r1", "w-dead")
    # r2: leased by w-dead once, since taken over by w-other (whose attempt is live).
    await _live(store, mine, "r2", "w-dead")
    s = await store.append(await store.load("r2"), f.aborted(await store.load("r2")))
    await other.take("r2", 30.0)
    await store.append(s, f.resumed(s, worker="w-other"))
    # r3: dropped by w-dead (finished or given back): no longer in its set.
    await _live(store, mine, "r3", "w-dead")
    await mine.drop("r3")
    assert await mine.held_by("w-dead") == ["r1", "r2"]
    await client.hset(KEYS.presence(), "w-dead", "1")  # registered; its connection is gone
    sync = redis.Redis.from_url(server.url)
    reaper = Reaper(store, Leases(client), sync, presence=watch(client))
    try:
        assert await reaper.reap_gone() == ["r1"]
        assert reaper.recovered_gone == 1
        r1 = await store.load("r1")
        assert r1.status is Status.ABORTED and r1.abort_reason is AbortReason.WORKER_LOST
        assert (await store.events("r1"))[-1].detail == GONE.format("w-dead")  # type: ignore[union-attr]
        assert await Leases(client).expiry("r1") is None
        assert rollout_queue(sync).count == 1  # requeued
        r2 = await store.load("r2")
        assert r2.status is Status.RESUMED and r2.worker_id == "w-other"
        assert await Leases(client).expiry("r2") is not None  # w-other's lease, untouched
        assert await client.hkeys(KEYS.presence()) == []
        assert await mine.held_by("w-dead") == []
        assert await reaper.reap_gone() == []
    finally:
        sync.close()


async def test_a_gone_workers_rollout_whose_enqueue_failed_is_given_back_by_its_lease(
    server: RedisServer, client: aredis.Redis
) -> None:
    # Before: the abort was recorded and the lease released, then the enqueue failed: the
    # rollout stayed aborted with no job and no lease, forever.
    store, sync = EventStore(client), redis.Redis.from_url(server.url)
    mine = Leases(client, holder="w-dead")
    await store.append(None, Submitted(rollout_id="r1", seq=1, request=f.request(32)))
    await mine.take("r1", 1.0)
    s = await store.append(
        await store.load("r1"), f.started(await store.load("r1"), worker="w-dead")
    )
    await store.append(s, f.tokens(s))
    await client.hset(KEYS.presence(), "w-dead", "1")  # registered; its connection is gone
    queue = rollout_queue(sync)
    sync.set(queue.key, "not a list")  # the enqueue fails (WRONGTYPE), as under Redis OOM
    reaper = Reaper(store, Leases(client), sync, presence=watch(client))
    try:
        assert await reaper.reap_gone() == []
        assert (await store.load("r1")).status is Status.ABORTED
        assert await Leases(client).expiry("r1") is not None  # kept for a retry
        sync.delete(queue.key)
        # Aborted already, so no longer the gone worker's live attempt: the next check leaves
        # it to its lease, which the passes over expired leases give back once it lapses.
        await client.delete(KEYS.presence_check())
        assert await reaper.reap_gone() == []

        async def given_back() -> bool:
            return await reaper.reap_once() == ["r1"]

        await until(given_back, timeout=10, what="the lapsed lease was not given back")
        assert queue.count == 1
        aborts = [e for e in await store.events("r1") if isinstance(e, Aborted)]
        assert len(aborts) == 1
    finally:
        sync.close()


# -- worker processes ---------------------------------------------------------------------------


async def redis_up_for(client: RolloutClient, seconds: float) -> None:
    """Until the server has been up ``seconds`` (the watch judges nobody before: a restart)."""

    async def up() -> bool:
        info = await client.store.redis.info("server")
        return int(info["uptime_in_seconds"]) >= seconds

    await until(up, timeout=seconds + 10, every=0.1)


async def registered(client: RolloutClient, *workers: str) -> bool:
    names = await client.store.redis.hkeys(KEYS.presence())
    return {w.encode() for w in workers} <= set(names)


async def attempt_at_least(client: RolloutClient, rid: str, n: int) -> bool:
    return (await client.store.load(rid)).attempt >= n


async def tokens_at_least(client: RolloutClient, rid: str, n: int) -> bool:
    return (await client.store.load(rid)).num_tokens >= n


async def worker_lost(client: RolloutClient, rid: str) -> list[Aborted]:
    events = await client.store.events(rid)
    return [e for e in events if isinstance(e, Aborted) and e.reason is AbortReason.WORKER_LOST]


async def generating_on(client: RolloutClient, rid: str, worker: str) -> bool:
    s = await client.store.load(rid)
    return s.status in (Status.GENERATING, Status.RESUMED) and s.worker_id == worker


async def test_kill_9_is_taken_over_because_the_process_is_gone(
    server: RedisServer, tmp_path: Path
) -> None:
    client = RolloutClient(server.url)
    await redis_up_for(client, defaults.PRESENCE_GRACE_S)
    prompt = random_prompts(1, seed=21)[0]
    [rid] = await client.submit([RolloutRequest(prompt_token_ids=prompt, sampling=greedy(2000))])
    # Default lease TTL (5 s): a takeover by expiry would say so in its abort.
    a = start_worker(server.url, SYNTHETIC, "a", tmp_path / "a.log", concurrency=1)
    b = None
    try:
        await until(lambda: generating_on(client, rid, "a"))
        b = start_worker(
            server.url, SYNTHETIC, "b", tmp_path / "b.log", concurrency=1, synthetic=UNPACED
        )
        await until(lambda: registered(client, "a", "b"))
        a.kill()
        a.wait(10)
        [result] = await client.wait([rid], timeout=120)
    finally:
        stop_procs(a, *(p for p in [b] if p))
    [lost] = await worker_lost(client, rid)
    assert lost.detail == GONE.format("a")
    log = (tmp_path / "b.log").read_text()
    assert "event=worker_gone" in log and "how=process_gone" in log
    [(ref, _)] = await direct_greedy(None, SYNTHETIC, [prompt], greedy(2000))
    np.testing.assert_array_equal(result.response_token_ids, ref)
    assert await client.store.redis.hkeys(KEYS.presence()) == []  # a forgotten, b unregistered
    await client.aclose()


async def test_sigstop_falls_back_to_the_lease_ttl_and_stays_fenced(
    server: RedisServer, tmp_path: Path
) -> None:
    client = RolloutClient(server.url)
    await redis_up_for(client, defaults.PRESENCE_GRACE_S)
    prompt = random_prompts(1, seed=22)[0]
    [rid] = await client.submit([RolloutRequest(prompt_token_ids=prompt, sampling=greedy(2000))])
    fast = ("--lease-ttl", "2", "--heartbeat", "0.25", "--checkpoint-tokens", "2")
    a = start_worker(server.url, SYNTHETIC, "stalled", tmp_path / "a.log", *fast, concurrency=1)
    b = None
    try:
        await until(lambda: tokens_at_least(client, rid, 8))
        b = start_worker(
            server.url, SYNTHETIC, "b", tmp_path / "b.log", *fast, concurrency=1, synthetic=UNPACED
        )
        await until(lambda: registered(client, "stalled", "b"))
        os.kill(a.pid, signal.SIGSTOP)  # alive, silent, its connections open
        await until(lambda: attempt_at_least(client, rid, 2))
        await until(lambda: tokens_at_least(client, rid, 40))
        os.kill(a.pid, signal.SIGCONT)  # it wakes up and tries to append what it buffered
        [result] = await client.wait([rid], timeout=120)
        assert a.poll() is None  # fenced out, not crashed
    finally:
        stop_procs(a, *(p for p in [b] if p))
    [lost] = await worker_lost(client, rid)
    assert lost.detail == EXPIRED.format("stalled")
    events = await client.store.events(rid)
    assert all(getattr(e, "attempt", 1) != 1 or e.seq <= lost.seq for e in events)
    [(ref, _)] = await direct_greedy(None, SYNTHETIC, [prompt], greedy(2000))
    np.testing.assert_array_equal(result.response_token_ids, ref)
    assert await client.store.load(rid) == await client.store.replay(rid)
    await client.aclose()


@pytest.mark.slow  # a worker scenario of 15-25 s: the full suite's
async def test_a_stalling_event_loop_keeps_its_rollouts(
    server: RedisServer, tmp_path: Path
) -> None:
    """Its loop blocked for 1.5 s every 0.2 s (renewals late, reads late, its connections
    open): watched all along, it keeps its rollouts; killed, it loses them at once."""
    client = RolloutClient(server.url)
    await redis_up_for(client, defaults.PRESENCE_GRACE_S)
    prompts = random_prompts(2, seed=23)
    ids = await client.submit(
        [RolloutRequest(prompt_token_ids=p, sampling=greedy(2000)) for p in prompts]
    )
    code = [sys.executable, "-m", "tests.workers.slow_loop_worker", server.url, "slow", "1.5"]
    with (tmp_path / "slow.log").open("wb") as out:
        slow = subprocess.Popen(code, stdout=out, stderr=subprocess.STDOUT)
    b = None
    try:
        for rid in ids:
            await until(lambda rid=rid: generating_on(client, rid, "slow"))  # type: ignore[misc]
        b = start_worker(server.url, SYNTHETIC, "b", tmp_path / "b.log", concurrency=2)
        await until(lambda: registered(client, "slow", "b"))
        # Several stalls later (about 40 tokens per rollout between two), watched by b.
        marks = [(await client.store.load(rid)).num_tokens for rid in ids]
        for rid, mark in zip(ids, marks, strict=True):
            await until(lambda rid=rid, mark=mark: tokens_at_least(client, rid, mark + 150))  # type: ignore[misc]
        for rid in ids:
            assert await worker_lost(client, rid) == []
            assert await generating_on(client, rid, "slow")
        slow.kill()
        slow.wait(10)
        results = await client.wait(ids, timeout=180)
    finally:
        stop_procs(slow, *(p for p in [b] if p))
    assert all(r.status is Status.DONE for r in results)
    for rid in ids:
        [lost] = await worker_lost(client, rid)
        assert lost.detail == GONE.format("slow")
    await client.aclose()


@pytest.mark.slow  # a worker scenario of 15-25 s: the full suite's
async def test_a_redis_restart_makes_nobody_look_dead(server: RedisServer, tmp_path: Path) -> None:
    """Redis killed and restarted while one worker is stopped (SIGSTOP) for 2 s, so that it
    reconnects well after everyone else: the other worker's watch sees it absent, but within
    the grace after the restart, and takes nothing over."""
    client = RolloutClient(server.url)
    await redis_up_for(client, defaults.PRESENCE_GRACE_S)  # so the guard is the restart's
    prompts = random_prompts(4, seed=24)
    ids = await client.submit(
        [RolloutRequest(prompt_token_ids=p, sampling=greedy(1500)) for p in prompts]
    )
    paced = ("--heartbeat", "0.25")  # default lease TTL: 5 s
    workers = [
        start_worker(server.url, SYNTHETIC, f"r{i}", tmp_path / f"r{i}.log", *paced)
        for i in range(2)
    ]
    try:
        await until(lambda: registered(client, "r0", "r1"))
        await until(lambda: _all_generating(client, ids))
        os.kill(workers[0].pid, signal.SIGSTOP)
        await asyncio.to_thread(server.restart, kill=True)  # SIGKILL; AOF fsync always
        await asyncio.sleep(2.0)
        os.kill(workers[0].pid, signal.SIGCONT)
        results = await client.wait(ids, timeout=180)
    finally:
        stop_procs(*workers)
    assert all(r.status is Status.DONE for r in results)
    for rid in ids:
        assert await worker_lost(client, rid) == []
        assert (await client.store.load(rid)).attempt == 1
        appended = [e for e in await client.store.events(rid) if isinstance(e, TokensAppended)]
        assert sum(len(e) for e in appended) == 1500
    # The guard is what held r1 back (r0 was absent for 2 s after the restart).
    assert "workers not reconnected yet" in (tmp_path / "r1.log").read_text()
    await client.aclose()


async def _all_generating(client: RolloutClient, ids: list[str]) -> bool:
    states = [await client.store.load(rid) for rid in ids]
    return all(s.status is Status.GENERATING and s.num_tokens > 0 for s in states)
