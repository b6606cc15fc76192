"""The reaper on fakeredis and on a real redis-server: each bad rollout affects only itself,
and work goes back to the queue it was submitted to."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import fakeredis
import pytest
import redis
import redis.asyncio as aredis
from rq import Queue

from statemachine import Aborted, AbortReason, Status, Submitted
from store import EventStore, defaults
from store.event_store import HEAD
from store.leases import Leases
from store.queue import rollout_queue
from store.redis_server import RedisServer
from tests import factories as f
from tests.damage import damage_event
from tests.workers.helpers import out_of_memory
from workers import reaper as reaper_module
from workers.engines.synthetic import SyntheticEngine
from workers.reaper import Reaper
from workers.worker import Worker, WorkerConfig


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
    await leases.redis.zadd(leases.key, {"for-qk": (await leases.read()).now_ms - 1000})
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
    t = (await leases.read()).now_ms  # Redis's clock, which judges leases
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
    t = (await leases.read()).now_ms  # Redis's clock, which judges leases
    await a.zadd(leases.key, {"flaky": t - 2000, "good": t - 1000})
    real_load = store.load

    async def load(rid: str):  # type: ignore[no-untyped-def]
        if rid == "flaky":
            raise redis.exceptions.ConnectionError("connection reset")
        return await real_load(rid)

    monkeypatch.setattr(store, "load", load)
    reaper = Reaper(store, leases, s)
    assert await reaper.reap_once() == ["good"]
    assert await leases.expiry("flaky") is not None  # still there: retried by a later pass
    monkeypatch.setattr(store, "load", real_load)
    assert await reaper.reap_once() == []  # not every pass: after its backoff
    await asyncio.sleep(defaults.REAP_RETRY_S + 0.2)
    assert await reaper.reap_once() == ["flaky"]
    events = await store.events("flaky")
    assert isinstance(events[-1], Aborted)


def _damage_queue(sync: redis.Redis, name: str = "rollouts") -> str:
    """The rq queue's key made a string: every push onto it fails (WRONGTYPE), as an enqueue
    refused under Redis OOM fails; ``sync.delete`` of the returned key repairs it."""
    key = rollout_queue(sync, name).key
    sync.set(key, "not a list")
    return key


async def test_a_failed_re_enqueue_leaves_the_lease_for_a_later_pass(server: RedisServer) -> None:
    # Before: the pass appended Aborted, released the lease, then the enqueue failed: no later
    # pass saw the rollout again, and it stayed aborted with no job and no lease, forever.
    a, s = aredis.Redis.from_url(server.url), redis.Redis.from_url(server.url)
    store, leases = EventStore(a), Leases(a)
    await _live(store, "r1")
    await a.zadd(leases.key, {"r1": (await leases.read()).now_ms - 1000})
    reaper = Reaper(store, leases, s)
    key = _damage_queue(s)
    assert await reaper.reap_once() == []
    assert (await store.load("r1")).status is Status.ABORTED  # the abort is recorded
    assert await leases.expiry("r1") is not None  # and the lease kept for the retry
    s.delete(key)
    await asyncio.sleep(defaults.REAP_RETRY_S + 0.2)  # the rollout's backoff
    assert await reaper.reap_once() == ["r1"]
    assert await leases.expiry("r1") is None
    assert _job_ids(rollout_queue(s)) == ["r1"]  # one job
    aborts = [e for e in await store.events("r1") if isinstance(e, Aborted)]
    assert len(aborts) == 1  # and one abort: the retry appended nothing
    # The job runs: the rollout finishes from its saved tokens.
    worker = Worker(WorkerConfig(redis_url=server.url, burst=True), SyntheticEngine())
    await asyncio.wait_for(worker.run(), 60)
    done = await store.load("r1")
    assert done.status is Status.DONE and done.num_tokens == 32
    await a.aclose()
    s.close()


async def test_rollouts_that_cannot_be_given_back_wait_apart_from_the_others(  # type: ignore[no-untyped-def]
    clients, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Three rollouts of a queue whose key is damaged (every enqueue onto it fails), the oldest
    # leases, and one of another queue behind them. Their leases now stay expired for a retry:
    # they must not fill every pass's window of the oldest leases, for ever.
    a, s = clients
    store, leases = EventStore(a), Leases(a)
    monkeypatch.setattr(reaper_module, "PASS_LIMIT", 2)
    t = (await leases.read()).now_ms  # Redis's clock, which judges leases
    for i, rid in enumerate(("bad1", "bad2", "bad3")):
        await _live(store, rid, queue="broken")
        await a.zadd(leases.key, {rid: t - 5000 + i})
    await _live(store, "good", queue="fine")
    await a.zadd(leases.key, {"good": t - 1000})
    key = _damage_queue(s, "broken")
    reaper = Reaper(store, leases, s)
    assert await reaper.reap_once() == []  # bad1 and bad2 failed: their retries wait
    assert await reaper.reap_once() == ["good"]  # skipped, they leave room for the rest
    assert _job_ids(rollout_queue(s, "fine")) == ["good"]
    for rid in ("bad1", "bad2", "bad3"):
        assert (await store.load(rid)).status is Status.ABORTED
        assert await leases.expiry(rid) is not None
    s.delete(key)
    await asyncio.sleep(defaults.REAP_RETRY_S + 0.2)
    assert sorted(await reaper.reap_once()) == ["bad1", "bad2", "bad3"]
    assert sorted(_job_ids(rollout_queue(s, "broken"))) == ["bad1", "bad2", "bad3"]


async def test_under_redis_oom_a_refused_give_back_writes_nothing_and_is_retried(
    server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The case on a real redis-server running out of memory (maxmemory, noeviction)
    # between the reaper's read of a rollout and its give back: its abort was recorded (by a
    # pass just before) and the enqueue is refused. Before, the lease went first (a ZREM, which
    # Redis allows out of memory) and the rollout was stranded.
    a, s = aredis.Redis.from_url(server.url), redis.Redis.from_url(server.url)
    # No grace after the refusals (tests/workers/test_refusal_grace.py has it): the retry of
    # the give back is what is tested here.
    store, leases = EventStore(a), Leases(a, refusal_grace_s=0)
    await _live(store, "r1")
    state = await store.load("r1")
    await store.append(state, f.aborted(state))
    await a.zadd(leases.key, {"r1": (await leases.read()).now_ms - 1000})
    reaper = Reaper(store, leases, s)
    async with contextlib.AsyncExitStack() as oom:
        real_load = store.load

        async def load_then_run_out(rid: str):  # type: ignore[no-untyped-def]
            state = await real_load(rid)
            await oom.enter_async_context(out_of_memory(a))
            return state

        monkeypatch.setattr(store, "load", load_then_run_out)
        assert await reaper.reap_once() == []
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            await a.set("probe", "x")  # out of memory indeed
        assert await leases.expiry("r1") is not None  # the lease kept
        assert rollout_queue(s).count == 0 and s.keys("rq:job:*") == []  # nothing written
    monkeypatch.setattr(store, "load", real_load)
    await asyncio.sleep(defaults.REAP_RETRY_S + 0.2)
    assert await reaper.reap_once() == ["r1"]
    assert _job_ids(rollout_queue(s)) == ["r1"]
    assert len([e for e in await store.events("r1") if isinstance(e, Aborted)]) == 1
    await a.aclose()
    s.close()


async def test_a_pass_sweeps_lost_tool_calls_at_its_own_cadence(clients) -> None:  # type: ignore[no-untyped-def]
    a, s = clients
    store, leases = EventStore(a), Leases(a)
    st = await store.append(None, f.episode_submitted("ep"))
    st = await store.append(st, f.started(st))
    st = await store.append(st, f.requested(st, "calc"))
    await store.append_chain(st, [f.claimed(st)], tool_lease_s=0.01)
    await asyncio.sleep(0.05)
    reaper = Reaper(store, leases, s)
    assert await reaper.reap_once() == []  # no generation lease was lost
    assert reaper.lost_calls == 1
    state = await store.head("ep")
    assert state.status is Status.AWAITING_TOOL and state.calls[0].unverified == 1
    # Claimed and lost again at once: the next pass is within TOOL_SWEEP_S, so it waits.
    await store.append_chain(state, [f.claimed(state)], tool_lease_s=0.01)
    await asyncio.sleep(0.05)
    await reaper.reap_once()
    assert reaper.lost_calls == 1
    reaper.tool_sweep_s = 0.0
    await reaper.reap_once()
    assert reaper.lost_calls == 2
