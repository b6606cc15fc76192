"""The queue on a Redis of its own (``--queue-redis``, store/queue_redis.py): the trainer's
side. Submit records on the store first, then pushes the jobs on the queue; ack deletes the
jobs on the queue, then the rollout on the store; stats read the depths from the queue.

On a real redis-server, the store on db 0 and the queue on db 1: a script runs in its
connection's db, so a step that still touches the wrong Redis finds nothing there (or leaves
its keys where the test looks for none)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aredis
from rq import Queue
from rq.job import Job
from rq.serializers import JSONSerializer

from statemachine import Status
from store import queue as rq_queue
from store.affinity import Affinity
from store.client import RolloutClient
from store.redis_server import RedisServer
from tests import factories as f
from tests.store.trainer import finish


def _db(server: RedisServer, db: int) -> str:
    return server.url.rsplit("/", 1)[0] + f"/{db}"


@pytest.fixture
async def dbs(redis_server: RedisServer) -> AsyncIterator[tuple[aredis.Redis, aredis.Redis]]:
    """The store's db (0) and the queue's (1), emptied."""
    store = aredis.Redis.from_url(_db(redis_server, 0))
    queue = aredis.Redis.from_url(_db(redis_server, 1))
    await store.flushall()
    yield store, queue
    await store.aclose()
    await queue.aclose()


@pytest.fixture
async def apart(
    redis_server: RedisServer, dbs: tuple[aredis.Redis, aredis.Redis]
) -> AsyncIterator[RolloutClient]:
    c = RolloutClient(_db(redis_server, 0), queue_url=_db(redis_server, 1))
    yield c
    await c.aclose()


def queued(client: RolloutClient) -> list[str]:
    """The rollout ids of the jobs waiting on the client's queue (its own Redis), in order."""
    q: Queue = client._queue
    return [job.kwargs["rollout_id"] for job in q.get_jobs()]


async def _separate(dbs: tuple[aredis.Redis, aredis.Redis]) -> None:
    """Nothing of rq's on the store, nothing of the store's on the queue but hint lists."""
    store, queue = dbs
    assert await store.keys("rq:*") == []
    on_queue = [k.decode() for k in await queue.keys("dr:*")]
    assert all(k.endswith(":hints") for k in on_queue), on_queue


async def test_the_client_knows_where_its_queue_is(apart: RolloutClient) -> None:
    assert apart.queue_apart
    assert apart.sync_redis.connection_pool.connection_kwargs["db"] == 1
    assert apart._queue.connection is apart.sync_redis


@pytest.mark.parametrize("named", [False, True], ids=["generated-ids", "named-ids"])
async def test_a_submit_records_on_the_store_and_enqueues_on_the_queue(
    apart: RolloutClient, dbs: tuple[aredis.Redis, aredis.Redis], named: bool
) -> None:
    ids = ["a", "b", "c"] if named else None
    batch = await apart.submit([f.request()] * (1 if named else 3), n=3 if named else 1,
                               ids=ids, batch_id="b1")  # fmt: skip
    assert sorted(queued(apart)) == sorted(batch) and len(batch) == 3
    assert await apart.statuses(list(batch)) == ["pending"] * 3
    store, _ = dbs
    for rid in batch:
        job_id = (await store.hget(apart.keys.snapshot(rid), "job")).decode()
        job = Job.fetch(job_id, connection=apart.sync_redis, serializer=JSONSerializer)
        assert job.kwargs == {"rollout_id": rid} and job.get_status() == "queued"
    await _separate(dbs)
    # A retry of the same submit records nothing more and pushes no second job.
    again = await apart.submit([f.request()] * (1 if named else 3), n=3 if named else 1,
                               ids=ids, batch_id="b1")  # fmt: skip
    assert list(again) == list(batch)
    assert sorted(queued(apart)) == sorted(batch)
    assert (await apart.stats()).by_state[Status.PENDING] == 3


async def test_a_submit_without_a_batch_id_on_the_event_loop_path(
    apart: RolloutClient, dbs: tuple[aredis.Redis, aredis.Redis]
) -> None:
    """One chunk of generated ids: the path a harness call takes."""
    batch = await apart.submit([f.request()], n=2)
    assert sorted(queued(apart)) == sorted(batch)
    await _separate(dbs)


@pytest.mark.parametrize("named", [False, True], ids=["generated-ids", "named-ids"])
async def test_a_crash_between_the_store_and_the_queue_is_repaired_by_the_retry(
    apart: RolloutClient, dbs: tuple[aredis.Redis, aredis.Redis],
    monkeypatch: pytest.MonkeyPatch, named: bool,
) -> None:  # fmt: skip
    real = rq_queue.push_jobs
    calls = {"n": 0}

    def crash_once(*args: Any, **kw: Any) -> int:
        calls["n"] += 1
        if calls["n"] == 1:
            raise ConnectionError("the queue's Redis went away after the store step")
        return real(*args, **kw)

    monkeypatch.setattr(rq_queue, "push_jobs", crash_once)
    ids = ["x", "y"] if named else None
    with pytest.raises(ConnectionError):
        await apart.submit([f.request()], n=2, ids=ids, batch_id="c1")
    # Recorded, with their job ids, and not enqueued.
    assert queued(apart) == []
    store, _ = dbs
    rids = ids or ["c1.0.0", "c1.0.1"]
    for rid in rids:
        assert await store.hget(apart.keys.snapshot(rid), "job")
    batch = await apart.submit([f.request()], n=2, ids=ids, batch_id="c1")
    assert sorted(queued(apart)) == sorted(batch) == sorted(rids)
    # The jobs pushed are the ones recorded (ack finds them).
    for rid in rids:
        job_id = (await store.hget(apart.keys.snapshot(rid), "job")).decode()
        assert Job.exists(job_id, connection=apart.sync_redis)
    # And a third try pushes nothing more.
    await apart.submit([f.request()], n=2, ids=ids, batch_id="c1")
    assert sorted(queued(apart)) == sorted(rids)
    await _separate(dbs)


async def test_a_session_call_hints_its_worker_on_the_queue(
    apart: RolloutClient, dbs: tuple[aredis.Redis, aredis.Redis],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    from store import sessions

    async def begin(*args: Any) -> tuple[bool, Affinity]:
        return False, Affinity("s1", "w7")

    monkeypatch.setattr(sessions, "begin", begin)
    batch = await apart.submit([f.request()], n=2, batch_id="h1")
    _, queue = dbs
    hints = await queue.lrange(apart.keys.worker_hints("w7"), 0, -1)
    assert len(hints) == 2
    for job_id in hints:
        job = Job.fetch(job_id.decode(), connection=apart.sync_redis, serializer=JSONSerializer)
        assert job.kwargs["rollout_id"] in batch
        # The session's fields, beside rq's (store.affinity): what a worker reads with the job.
        raw = await queue.hgetall(Job.key_for(job_id.decode()))
        assert raw[b"session"] == b"s1" and raw[b"prefer"] == b"w7"
    await _separate(dbs)


async def test_ack_deletes_the_rollout_on_the_store_and_its_jobs_on_the_queue(
    apart: RolloutClient, dbs: tuple[aredis.Redis, aredis.Redis]
) -> None:
    store, queue = dbs
    batch = await apart.submit([f.request()], n=2, batch_id="k1")
    done, pending = batch
    await finish(apart.store, done)
    report = await apart.ack(batch_id="k1")
    assert report.acked == [done] and report.live == [pending]
    assert not await store.exists(apart.keys.snapshot(done), apart.keys.log(done))
    # The done rollout's job hash is gone (its id stays in the list, as the one-Redis ack
    # leaves it), the pending one's is there.
    [left] = await queue.keys("rq:job:*")
    job = Job.fetch(left.decode().split(":")[-1], connection=apart.sync_redis,
                    serializer=JSONSerializer)  # fmt: skip
    assert job.kwargs["rollout_id"] == pending
    # Again: nothing more to do, nothing refused.
    assert (await apart.ack([done])).missing == [done]
    await _separate(dbs)


async def test_ack_leaves_a_started_job_to_its_worker(
    apart: RolloutClient, dbs: tuple[aredis.Redis, aredis.Redis]
) -> None:
    store, queue = dbs
    [rid] = await apart.submit([f.request()], batch_id="k2")
    job_id = (await store.hget(apart.keys.snapshot(rid), "job")).decode()
    await queue.hset(Job.key_for(job_id), "status", "started")
    await finish(apart.store, rid)
    assert (await apart.ack([rid])).acked == [rid]
    assert await queue.exists(Job.key_for(job_id))  # its worker deletes it (job_endings)
    assert not await store.exists(apart.keys.snapshot(rid))


async def test_ack_finished_job_leaves_no_registry_entry(
    apart: RolloutClient, dbs: tuple[aredis.Redis, aredis.Redis]
) -> None:
    store, queue = dbs
    [rid] = await apart.submit([f.request()], batch_id="k3")
    job_id = (await store.hget(apart.keys.snapshot(rid), "job")).decode()
    finished = apart._queue.finished_job_registry.key
    await queue.hset(Job.key_for(job_id), "status", "finished")
    await queue.zadd(finished, {job_id: 1})
    await finish(apart.store, rid)
    assert (await apart.ack([rid])).acked == [rid]
    assert await queue.zcard(finished) == 0 and not await queue.exists(Job.key_for(job_id))


async def test_stats_read_the_queue_depths_on_the_queue(
    apart: RolloutClient, dbs: tuple[aredis.Redis, aredis.Redis]
) -> None:
    await apart.submit([f.request()] * 3, n=2)
    stats = await apart.stats()
    assert stats.queues == {"rollouts": 6}
    assert stats.by_state[Status.PENDING] == 6


async def test_the_sync_client_takes_the_queue_too(
    redis_server: RedisServer, dbs: tuple[aredis.Redis, aredis.Redis]
) -> None:
    from store.sync_client import SyncRolloutClient

    sync = SyncRolloutClient(_db(redis_server, 0), queue_url=_db(redis_server, 1))
    try:
        batch = sync.submit([f.request()], n=2)
        assert sync.stats().queues == {"rollouts": 2}
        assert len(batch) == 2
    finally:
        sync.close()
    await _separate(dbs)


async def test_one_redis_is_not_apart(redis_server: RedisServer) -> None:
    same = RolloutClient(redis_server.url, queue_url=redis_server.url)
    try:
        assert not same.queue_apart and same.sync_store is same.sync_redis
    finally:
        await same.aclose()


async def test_a_failure_between_chunks_is_repaired_by_the_retry(
    apart: RolloutClient, dbs: tuple[aredis.Redis, aredis.Redis],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """The second chunk fails while it is built: the first is recorded on the store and, the
    queue step never reached, enqueued by nobody; the retry enqueues every rollout once."""
    from store import submit_apart

    real = submit_apart.chunk_call
    calls = {"n": 0}

    def flaky(*args: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:
            raise ConnectionError("Redis went away between chunks")
        return real(*args)

    monkeypatch.setattr(submit_apart, "chunk_call", flaky)
    prompts = [f.request()] * 5
    with pytest.raises(ConnectionError):
        await apart.submit(prompts, n=120, batch_id="big")  # 600 rollouts: 3 chunks
    assert queued(apart) == []
    assert (await apart.stats()).by_state[Status.PENDING] == 250
    monkeypatch.setattr(submit_apart, "chunk_call", real)
    batch = await apart.submit(prompts, n=120, batch_id="big")
    assert sorted(queued(apart)) == sorted(batch) and len(batch) == 600
    await _separate(dbs)


async def test_a_store_step_run_twice_answers_dup_with_status_and_job(
    apart: RolloutClient, dbs: tuple[aredis.Redis, aredis.Redis]
) -> None:
    """What a windowed call whose reply was lost meets when it runs again: "dup", with the
    rollout's status and the job id it recorded the first time."""
    from store import scripts, submit_apart
    from store.batches import _chunks

    store, _ = dbs
    events = [f.submitted(f"r{i}") for i in range(2)]
    part = next(_chunks(apart.store, events, 250, 1 << 20))
    keys, args = submit_apart.chunk_call(apart.keys, part)
    first = scripts.run_sync(apart.sync_store, scripts.SUBMIT_CHUNK, keys, args)
    again = scripts.run_sync(apart.sync_store, scripts.SUBMIT_CHUNK, keys, args)
    assert [r[:2] for r in first] == [[b"ok", b"pending"]] * 2
    assert again == [[b"dup", b"pending", r[2]] for r in first]
    for e, r in zip(events, first, strict=True):
        assert await store.hget(apart.keys.snapshot(e.rollout_id), "job") == r[2]
    assert await store.hget(apart.keys.stats(), "pending") == b"2"
