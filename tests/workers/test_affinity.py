"""Session affinity at the dequeue (store/affinity.py, workers/affinity.py), on a real
redis-server with two rq bridges and the real submit: a session's next call claimed by the
worker that started its previous one ahead of the queue, or handed to it while it is blocked
on the queue even when another worker blocked first; never waiting for it when it is busy; a
hint whose job another worker took is skipped (no second run); session-less jobs carry
nothing and cost the dequeue no round trip more. The scripts alone run on fakeredis."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

import fakeredis
import pytest
import pytest_asyncio
import redis.asyncio.connection as aconnection
import redis.connection
from redis import Redis
from rq.job import Job

from store import defaults, scripts
from store.cancel_safe import _CancelSafe
from store.client import RolloutClient
from store.keys import Keys
from store.redis_server import RedisServer
from tests import factories as f
from tests.workers.helpers import until
from workers.rq_bridge import RqBridge, TakenJob

pytestmark = pytest.mark.redis_server

S = "trajectory:{7}"
K = Keys()
Q, INTER = "rq:queue:rollouts", "rq:intermediate:rollouts"


@pytest_asyncio.fixture
async def pair(server: RedisServer) -> AsyncIterator[tuple[RqBridge, RqBridge]]:
    """Two registered workers, w1 and w2, on the default queue."""
    w1, w2 = RqBridge(server.url, ["rollouts"], "w1"), RqBridge(server.url, ["rollouts"], "w2")
    await w1.register()
    await w2.register()
    yield w1, w2
    await w1.close()
    await w2.close()


@pytest_asyncio.fixture
async def client(server: RedisServer) -> AsyncIterator[RolloutClient]:
    c = RolloutClient(server.url)
    yield c
    await c.aclose()


@contextmanager
def round_trips() -> Iterator[list[int]]:
    """Counts every request sent to Redis (a command, or a whole pipeline) by any client of
    this process, sync or async: ``[count]`` once the block ends."""
    counted = [0]
    sync_send = redis.connection.AbstractConnection.send_packed_command
    async_send = aconnection.AbstractConnection.send_packed_command

    def send(self: Any, *a: Any, **kw: Any) -> Any:
        counted[0] += 1
        return sync_send(self, *a, **kw)

    async def asend(self: Any, *a: Any, **kw: Any) -> Any:
        counted[0] += 1
        return await async_send(self, *a, **kw)

    safe_send = _CancelSafe.send_packed_command

    async def safe(self: Any, *a: Any, **kw: Any) -> Any:
        counted[0] += 1
        return await safe_send(self, *a, **kw)

    redis.connection.AbstractConnection.send_packed_command = send  # type: ignore[method-assign]
    aconnection.AbstractConnection.send_packed_command = asend  # type: ignore[method-assign]
    _CancelSafe.send_packed_command = safe  # type: ignore[method-assign]
    try:
        yield counted
    finally:
        redis.connection.AbstractConnection.send_packed_command = sync_send  # type: ignore[method-assign]
        aconnection.AbstractConnection.send_packed_command = async_send  # type: ignore[method-assign]
        _CancelSafe.send_packed_command = safe_send  # type: ignore[method-assign]


def ids(taken: list[TakenJob]) -> list[str]:
    return [t.rollout_id for t in taken]


async def first_call_served_by(client: RolloutClient, w: RqBridge) -> None:
    await client.submit([f.request()], batch_id="c1", session=S)
    assert ids(await w.dequeue_many(1, 1)) == ["c1.0.0"]  # started (awaited): recorded


async def test_the_worker_that_started_a_call_is_the_sessions_worker(
    client: RolloutClient, pair: tuple[RqBridge, RqBridge], sync: Redis
) -> None:
    w1, _ = pair
    await client.submit([f.request()], batch_id="c1", session=S)
    assert sync.get(K.session_worker(S)) == b""  # made with the index, no worker yet
    assert abs(sync.ttl(K.session_worker(S)) - sync.ttl(K.session(S))) <= 1
    assert ids(await w1.dequeue_many(1, 1)) == ["c1.0.0"]
    assert sync.get(K.session_worker(S)) == b"w1"
    assert abs(sync.ttl(K.session_worker(S)) - sync.ttl(K.session(S))) <= 1  # KEEPTTL
    # The next call's jobs carry the session and the worker they prefer; hinted to it.
    await client.submit([f.request(prompt=(4, 5))], n=2, batch_id="c2", session=S)
    job = sync.hget(K.snapshot("c2.0.0"), "job").decode()  # type: ignore[union-attr]
    fields = sync.hgetall(Job.key_for(job))
    assert (fields[b"session"], fields[b"prefer"]) == (S.encode(), b"w1")
    assert len(sync.lrange(K.worker_hints("w1"), 0, -1)) == 2
    assert 0 < sync.pttl(K.worker_hints("w1")) <= defaults.AFFINITY_HINTS_TTL_S * 1000
    # Acknowledging the session deletes its worker record with its index.
    await client.cancel(session=S)
    await client.ack(session=S)
    assert not sync.exists(K.session(S), K.session_worker(S))


async def test_a_free_worker_claims_its_sessions_call_ahead_of_the_queue(
    client: RolloutClient, pair: tuple[RqBridge, RqBridge], sync: Redis
) -> None:
    w1, w2 = pair
    await first_call_served_by(client, w1)
    await client.submit([f.request(prompt=(9, i)) for i in range(3)], batch_id="plain")
    await client.submit([f.request(prompt=(4, 5))], batch_id="c2", session=S)
    # w2 takes the head of the queue; w1, with one free slot, its hinted call at the tail.
    assert ids(await w2.dequeue_many(1, 1)) == ["plain.0.0"]
    assert ids(await w1.dequeue_many(1, 1)) == ["c2.0.0"]
    assert sync.llen(K.worker_hints("w1")) == 0
    assert sync.lrange(Q, 0, -1) and sync.llen(Q) == 2  # the other two wait where they were
    assert sync.llen(INTER) == 0  # started, out of rq's intermediate list as rq leaves it


async def test_a_blocked_worker_gets_its_sessions_call_before_one_blocked_earlier(
    client: RolloutClient, pair: tuple[RqBridge, RqBridge], sync: Redis
) -> None:
    """Redis hands a pushed job to the worker blocked longest: w2 here. It gives the job back
    for w1, which is waiting too, and w1 runs it; w2 goes on waiting."""
    w1, w2 = pair
    await first_call_served_by(client, w1)
    second = asyncio.create_task(w2.dequeue_many(5, 1))
    await until(blocked(sync, 1), 10, "w2 never blocked")
    first = asyncio.create_task(w1.dequeue_many(5, 1))
    await until(_exists(sync, K.worker_waiting("w1")), 10, "w1 never blocked")
    assert not sync.exists(K.worker_waiting("w2"))  # nobody's worker: never flagged
    sent = time.monotonic()
    await client.submit([f.request(prompt=(4, 5))], batch_id="c2", session=S)
    assert ids(await first) == ["c2.0.0"]
    assert time.monotonic() - sent < 1.0  # at once, not after a blocking pop's timeout
    assert await second == []  # w2 took it, gave it back, and returned empty-handed
    job = sync.hget(K.snapshot("c2.0.0"), "job").decode()  # type: ignore[union-attr]
    assert sync.hget(Job.key_for(job), "bounces") == b"1"
    assert sync.hget(Job.key_for(job), "worker_name") == b"w1"
    assert not sync.exists(K.worker_waiting("w1"), K.worker_waiting("w2"))


async def test_a_busy_workers_call_goes_to_another_at_once_and_its_hint_is_skipped(
    client: RolloutClient, pair: tuple[RqBridge, RqBridge], sync: Redis
) -> None:
    """w1 takes nothing (busy, or dead): w2 serves the call without waiting. When w1 has a free
    slot again its hint names a job already taken: it is dropped, the job not run twice."""
    w1, w2 = pair
    await first_call_served_by(client, w1)
    waiting = asyncio.create_task(w2.dequeue_many(5, 1))
    await until(blocked(sync, 1), 10, "w2 never blocked")
    sent = time.monotonic()
    await client.submit([f.request(prompt=(4, 5))], batch_id="c2", session=S)
    assert ids(await waiting) == ["c2.0.0"]
    assert time.monotonic() - sent < 1.0
    assert sync.llen(K.worker_hints("w1")) == 1  # hinted to w1, which never came
    await client.submit([f.request(prompt=(9, 9))], batch_id="plain")
    assert ids(await w1.dequeue_many(1, 4)) == ["plain.0.0"]  # the stale hint is skipped
    assert sync.llen(K.worker_hints("w1")) == 0
    assert sync.zcard("rq:wip:rollouts") == 3  # c1 (w1), c2 (w2), plain (w1): each once
    assert sync.get(K.session_worker(S)) == b"w2"  # the next call prefers w2 now


async def test_session_less_jobs_carry_nothing_and_cost_no_round_trip_more(
    client: RolloutClient, pair: tuple[RqBridge, RqBridge], sync: Redis
) -> None:
    """The dequeue's round trips for session-less jobs: 3 for jobs already queued (the queue's
    length and the workers on it; the moves; the jobs' hashes) and 2 for one waited for (the
    blocking pop; the job's hash), as before affinity; the start is one more, on the books
    thread. Nothing of affinity is written: no job field, no hint, no session record, and a
    worker that never started a session's call sends no command of it."""
    w1, w2 = pair
    await client.submit([f.request()], batch_id="warm")  # scripts loaded, connections made
    sync.delete(Q)
    with round_trips() as submit:
        await client.submit([f.request(prompt=(9, i)) for i in range(4)], batch_id="plain")
    before = _counts(sync)
    with round_trips() as queued:
        taken = await w1.dequeue_many(1, 2)
    assert ids(taken) == ["plain.0.0", "plain.1.0"]
    assert queued[0] == 3 + 1
    # A worker that never started a session's call is nobody's: no claim, no waiting flag.
    assert _counts(sync) == before
    sync.delete(Q)  # the ones left, gone: w2 waits for the next
    pending = asyncio.create_task(w2.dequeue_many(5, 1))
    await until(blocked(sync, 1), 10, "w2 never blocked")
    with round_trips() as waited:
        # The blocking pop was sent before: it answers the submit's push.
        await client.submit([f.request(prompt=(7, 7))], batch_id="late")
        assert ids(await pending) == ["late.0.0"]
    assert waited[0] == submit[0] + 1 + 1  # the submit's; the job's hash; the start
    for rid in ("plain.0.0", "late.0.0"):
        job = sync.hget(K.snapshot(rid), "job").decode()  # type: ignore[union-attr]
        assert not {b"session", b"prefer", b"bounces"} & set(sync.hkeys(Job.key_for(job)))
    assert not sync.keys("dr:worker:*:hints") and not sync.keys("dr:session:*")


async def test_a_sessions_call_costs_the_submit_no_round_trip_more(
    client: RolloutClient, sync: Redis
) -> None:
    """The session's index entry was one round trip before affinity; it now also makes and
    reads the session's worker record in it, and the hint rides in the enqueue's own script."""
    await client.submit([f.request()], batch_id="warm")  # scripts loaded, connections made
    await client.submit([f.request()], batch_id="warm-s", session="other")
    with round_trips() as plain:
        await client.submit([f.request(prompt=(1, 1))], batch_id="p")
    with round_trips() as first:
        await client.submit([f.request(prompt=(1, 2))], batch_id="s1", session=S)
    sync.set(K.session_worker(S), "w1", xx=True, keepttl=True)
    with round_trips() as hinted:
        await client.submit([f.request(prompt=(1, 3))], batch_id="s2", session=S)
    assert first[0] == hinted[0] == plain[0] + 1  # the index's entry, as before
    assert sync.lrange(K.worker_hints("w1"), 0, -1) == [sync.hget(K.snapshot("s2.0.0"), "job")]


def _counts(sync: Redis) -> dict[str, int]:
    """How often Redis ran the commands only affinity sends here (a script's calls included):
    the waiting flag's SET, the claim's LPOP of the hint list."""
    stats = sync.info("commandstats")
    return {c: stats.get(f"cmdstat_{c}", {}).get("calls", 0) for c in ("set", "lpop")}


def blocked(sync: Redis, n: int) -> Any:
    """Whether ``n`` clients are blocked in a BLMOVE (workers waiting on an empty queue)."""

    async def check() -> bool:
        return sum(c.get("cmd") == "blmove" for c in sync.client_list()) >= n

    return check


def _exists(sync: Redis, key: str) -> Any:
    async def check() -> bool:
        return bool(sync.exists(key))

    return check


# -- the scripts alone (fakeredis) --------------------------------------------------------------


def test_claim_takes_hinted_jobs_still_queued_and_drops_the_others() -> None:
    r = fakeredis.FakeRedis()
    r.rpush(Q, "a", "b", "c", "d")
    r.rpush("hints", "x", "c", "y", "a", "b")  # x, y: taken by others already
    claim = scripts.CLAIM_HINTS
    assert scripts.run_sync(r, claim, ["hints", Q, INTER], [2]) == [b"c", b"a"]
    assert r.lrange(Q, 0, -1) == [b"b", b"d"] and r.lrange(INTER, 0, -1) == [b"c", b"a"]
    assert r.lrange("hints", 0, -1) == [b"b"]
    # At most n + 4 hints looked at per call: a long list of stale ones drains by parts.
    r.rpush("hints", *[f"stale{i}" for i in range(10)])
    assert scripts.run_sync(r, claim, ["hints", Q, INTER], [1]) == [b"b"]
    assert scripts.run_sync(r, claim, ["hints", Q, INTER], [1]) == []
    assert r.llen("hints") == 10 - 5


def test_bounce_only_to_a_waiting_worker_and_only_so_often() -> None:
    r = fakeredis.FakeRedis()
    bounce = scripts.BOUNCE_JOB
    keys = ["waiting", "job", INTER, Q]
    r.hset("job", "status", "queued")
    r.rpush(INTER, "j")
    assert scripts.run_sync(r, bounce, keys, ["j", 2]) == 0  # nobody waiting: keep it
    r.set("waiting", "rq:queue:other")  # waiting, on another queue: keep it
    assert scripts.run_sync(r, bounce, keys, ["j", 2]) == 0
    r.set("waiting", Q)
    assert scripts.run_sync(r, bounce, keys, ["j", 2]) == 1
    assert r.lrange(Q, 0, -1) == [b"j"] and r.llen(INTER) == 0
    r.lmove(Q, INTER)
    assert scripts.run_sync(r, bounce, keys, ["j", 2]) == 1
    r.lmove(Q, INTER)
    assert scripts.run_sync(r, bounce, keys, ["j", 2]) == 0  # bounced twice: kept now
    assert r.lrange(INTER, 0, -1) == [b"j"]
    r.delete("job")  # acknowledged meanwhile: kept (its run ends it), never recreated
    assert scripts.run_sync(r, bounce, keys, ["j", 2]) == 0 and not r.exists("job")
