"""A trainer acknowledges a rollout the moment it ends, while the worker's rq bookkeeping of
its job is still in motion: nothing of the acknowledged rollout may stay in Redis.

Seen in CI (tests/workers/test_trainer_loop.py, 1 of 1,000 rollouts): a bare ``rq:job:<id>``
hash holding only ``last_heartbeat`` outlived the ack. The heartbeat had been queued on the
bookkeeping thread behind the job's success and still listed the job as running: the ack
deleted the job between the two, and the heartbeat's HSET wrote it back, with no TTL.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest
from redis import Redis
from rq.job import Job
from rq.serializers import JSONSerializer

from store import EventStore
from store.client import RolloutClient
from store.redis_server import RedisServer
from tests import factories as f
from workers.rq_bridge import RqBridge
from workers.rq_mirror import RqBooks

pytestmark = pytest.mark.redis_server


async def _finish_rollout(store: EventStore, rid: str) -> None:
    s = await store.load(rid)
    s = await store.append(s, f.started(s))
    s = await store.append(s, f.tokens(s))
    await store.append(s, f.finished(s))


async def test_a_heartbeat_queued_behind_the_success_does_not_recreate_an_acked_job(
    server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = RolloutClient(server.url)
    sync = Redis.from_url(server.url)
    bridge = RqBridge(server.url, ["rollouts"], "w1")
    try:
        await bridge.register()
        batch = await client.submit([f.request(4)], batch_id="b")
        rid = batch[0]
        (taken,) = await bridge.dequeue_many(1, 1)
        assert taken.rollout_id == rid
        await _finish_rollout(client.store, rid)

        real_books = bridge._books

        async def books(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            out = await real_books(fn, *args, **kwargs)
            # The books call that records successes (one per job before they were batched).
            if getattr(fn, "__name__", "") in ("guarded", "_record_successes"):
                # The interleaving, made certain: the success is written, the trainer acks
                # at once, and the heartbeat that was queued behind the success runs before
                # the event loop has taken the job off the running list.
                report = await client.ack([rid])
                assert report.acked == [rid]
                assert not sync.exists(taken.job.key)
                await bridge.heartbeat()
            return out

        monkeypatch.setattr(bridge, "_books", books)
        await bridge.succeed(taken, {"status": "done"})
        assert not sync.exists(taken.job.key), sync.hgetall(taken.job.key)
        assert not [k for k in sync.keys("dr:*") if rid.encode() in k]
    finally:
        await bridge.close()
        await client.aclose()
        sync.close()


async def test_a_success_recorded_as_its_rollout_is_acknowledged_leaves_nothing_if_killed(
    server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The soak's left-over ``finished`` rq jobs (issue 28, memory back to baseline; the
    slow-link worker, SIGKILLed a few seconds after its last successes): the trainer
    acknowledged the rollout after the worker read that the job was still started by it and
    before the transaction recording its success (ack leaves a started job to its worker);
    that transaction wrote the job back as finished (kept an hour), and the deletion that
    was to follow, a round trip later over the slow link, never came: the worker was
    killed. Whatever the worker does after that transaction, nothing of the rollout may stay."""
    client = RolloutClient(server.url)
    sync = Redis.from_url(server.url)
    bridge = RqBridge(server.url, ["rollouts"], "w1")
    loop = asyncio.get_running_loop()
    try:
        await bridge.register()
        (rid,) = await client.submit([f.request(4)], batch_id="b")
        (taken,) = await bridge.dequeue_many(1, 1)
        await _finish_rollout(client.store, rid)
        real_success = RqBooks._success
        acked = []

        def success(self: RqBooks, r: Any, result: Any, ended_at: Any, pipe: Any) -> None:
            # On the books thread, between the read of whose the job is and the transaction.
            if not acked:
                done = asyncio.run_coroutine_threadsafe(client.ack([rid]), loop).result(10)
                acked.append(done.acked)
            real_success(self, r, result, ended_at, pipe)

        monkeypatch.setattr(RqBooks, "_success", success)
        # SIGKILLed right after the transaction: nothing the worker would do next is done.
        monkeypatch.setattr(RqBooks, "delete_acknowledged", lambda self, recorded: None)
        await bridge.succeed(taken, {"status": "done"})

        assert acked == [[rid]]
        assert _rq_keys_of(sync, taken.job.id) == [], sync.hgetall(taken.job.key)
        assert sync.zcard(taken.queue.finished_job_registry.key) == 0
        assert sync.zcard(taken.queue.started_job_registry.key) == 0
    finally:
        await bridge.close()
        await client.aclose()
        sync.close()


def _rq_keys_of(sync: Redis, job_id: str) -> list[bytes]:
    """Every rq key of a job: its hash, results, executions index and execution hashes."""
    return sorted(k for k in sync.keys("rq:*") if job_id.encode() in k)


async def test_a_dead_workers_job_swept_back_after_the_ack_is_deleted_when_refused(
    server: RedisServer,
) -> None:
    """The soak's left-over rq jobs (issue 28, memory back to baseline): a killed worker's job
    is still started when its rollout, taken over and finished elsewhere, is acknowledged
    (ack leaves a started job to its worker); once its execution lapses the sweep gives it
    back, and the worker that takes it refuses it (no rollout) and deletes it. That deletion
    read each execution of the job (rq's ``ExecutionRegistry.delete``) and raised on the
    dead worker's, whose hash had expired: the job stayed failed, and the retried
    bookkeeping found it no longer started, so nothing deleted it."""
    client = RolloutClient(server.url)
    sync = Redis.from_url(server.url)
    dead = RqBridge(server.url, ["rollouts"], "dead", execution_ttl_s=1)
    live = RqBridge(server.url, ["rollouts"], "live")
    try:
        await dead.register()
        await live.register()
        (rid,) = await client.submit([f.request(4)], batch_id="b")
        (killed,) = await dead.dequeue_many(1, 1)  # then SIGKILLed: never beats nor ends it
        await _finish_rollout(client.store, rid)  # taken over and finished elsewhere
        assert (await client.ack([rid])).acked == [rid]
        assert sync.hget(killed.job.key, "status") == b"started"  # left to its worker
        await asyncio.sleep(1.5)  # its execution lapses, and its hash expires
        assert await live.requeue_abandoned() == [killed.job.id]
        (again,) = await live.dequeue_many(1, 1)
        assert again.job.id == killed.job.id

        await live.fail(again, f"no rollout {rid!r}")  # what the runner does with it

        assert _rq_keys_of(sync, killed.job.id) == []
        assert sync.zcard(again.queue.failed_job_registry.key) == 0
    finally:
        await dead.close()
        await live.close()
        await client.aclose()
        sync.close()


async def test_a_superseded_job_of_an_acknowledged_rollout_is_deleted(
    server: RedisServer,
) -> None:
    """A job found superseded (another attempt owns its rollout) whose rollout is then
    acknowledged before the job's end is written: ack leaves the started job to its worker,
    whose end must delete it, not list it as canceled for good (its hash has no TTL)."""
    client = RolloutClient(server.url)
    sync = Redis.from_url(server.url)
    bridge = RqBridge(server.url, ["rollouts"], "w1")
    try:
        await bridge.register()
        (rid,) = await client.submit([f.request(4)], batch_id="b")
        (taken,) = await bridge.dequeue_many(1, 1)
        await _finish_rollout(client.store, rid)
        assert (await client.ack([rid])).acked == [rid]

        await bridge.supersede(taken)

        assert _rq_keys_of(sync, taken.job.id) == []
        assert sync.zcard(taken.queue.canceled_job_registry.key) == 0
    finally:
        await bridge.close()
        await client.aclose()
        sync.close()


@pytest.mark.parametrize("await_start", [True, False])
async def test_a_job_taken_as_its_rollout_is_acknowledged_is_not_written_back(
    server: RedisServer, monkeypatch: pytest.MonkeyPatch, await_start: bool
) -> None:
    """A worker pops and reads a queued job (a second job of a rollout that ended), the
    trainer acknowledges the rollout (deleting the queued job), then the worker's start
    marks the job started: that write recreated the hash as a bare one (no payload, no TTL),
    which rq's own sweep then called abandoned, the fleet's sweep gave back, and every
    dequeue skipped: left in Redis for good (the soak's partial ``rq:job`` hashes)."""
    client = RolloutClient(server.url)
    sync = Redis.from_url(server.url)
    bridge = RqBridge(server.url, ["rollouts"], "w1")
    loop = asyncio.get_running_loop()
    try:
        await bridge.register()
        (rid,) = await client.submit([f.request(4)], batch_id="b")
        await _finish_rollout(client.store, rid)
        real_take = bridge._take

        def take(timeout: int, limit: int) -> Any:
            found = real_take(timeout, limit)
            # On the dequeue thread, between the pop and the start.
            done = asyncio.run_coroutine_threadsafe(client.ack([rid]), loop).result(10)
            assert done.acked == [rid]
            return found

        monkeypatch.setattr(bridge, "_take", take)
        (taken,) = await bridge.dequeue_many(1, 1, await_start=await_start)
        await bridge._books(lambda: None)  # the start, if queued, is done
        taken.started = True  # beaten as a started job would be
        await bridge.heartbeat()
        assert not sync.exists(taken.job.key), sync.hgetall(taken.job.key)

        await bridge.fail(taken, f"no rollout {rid!r}")  # what the runner does with it
        assert _rq_keys_of(sync, taken.job.id) == []
        assert sync.zcard(taken.queue.started_job_registry.key) == 0
    finally:
        await bridge.close()
        await client.aclose()
        sync.close()


async def test_the_sweep_deletes_job_hashes_written_back_without_their_job(
    bridge: RqBridge, sync: Redis
) -> None:
    """What earlier code left (a job's fields written back after the job was deleted: no
    payload) is no job to give back: the sweep deletes it where it finds it, in the started
    registry with a lapsed execution or in rq's intermediate list, instead of pushing it
    (every dequeue then skipped it, and it went round for good)."""
    queue = bridge.queues[0]
    stamp = "2026-01-01T00:00:00.000000Z"
    started, popped = "started-remnant", "popped-remnant"
    sync.hset(Job.key_for(started), mapping={
        "last_heartbeat": stamp, "status": "started", "started_at": stamp, "worker_name": "x",
    })  # fmt: skip
    sync.zadd(queue.started_job_registry.key, {f"{started}:e1": time.time() - 60})
    sync.hset(Job.key_for(popped), mapping={
        "last_heartbeat": stamp, "status": "queued", "enqueued_at": stamp,
    })  # fmt: skip
    sync.rpush(queue.intermediate_queue_key, popped)

    assert await bridge.requeue_abandoned() == []

    assert not sync.exists(Job.key_for(started), Job.key_for(popped))
    assert sync.zcard(queue.started_job_registry.key) == 0
    assert sync.llen(queue.intermediate_queue_key) == 0
    assert sync.llen(queue.key) == 0


async def test_the_sweep_deletes_failed_jobs_whose_rollout_is_gone(
    server: RedisServer, bridge: RqBridge, sync: Redis
) -> None:
    """A refused job whose rollout was acknowledged, left failed by earlier code (or by a
    worker that died between writing the failure and deleting the job), is deleted by the
    sweep; a failed job of a live rollout, and one that is no rollout job, are kept."""
    client = RolloutClient(server.url)
    try:
        gone, kept = await client.submit([f.request(4), f.request(4)], batch_id="b")
        taken = await bridge.dequeue_many(1, 2)
        await bridge._books(lambda: None)
        by_rollout = {t.rollout_id: t for t in taken}
        for t in taken:  # refused, rq's way, and left failed
            bridge.rq_books.worker.handle_job_failure(t.job, t.queue, exc_string="refused",
                                                      execution=t.execution)  # fmt: skip
        junk = Job.create("not.a.rollout", connection=sync, serializer=JSONSerializer)
        junk.origin = "rollouts"
        junk.save()
        bridge.queues[0].failed_job_registry.add(junk, exc_string="refused")
        await _finish_rollout(client.store, gone)
        sync.delete(client.store.keys.snapshot(gone), client.store.keys.log(gone))  # acked

        await bridge.requeue_abandoned()

        assert _rq_keys_of(sync, by_rollout[gone].job.id) == []
        assert sync.exists(by_rollout[kept].job.key) and sync.exists(junk.key)
        failed = {i.decode() for i in sync.zrange(bridge.queues[0].failed_job_registry.key, 0, -1)}
        assert failed == {by_rollout[kept].job.id, junk.id}
    finally:
        await client.aclose()


async def test_a_refused_jobs_deletion_is_done_by_the_retry_of_its_bookkeeping(
    server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The refusal's bookkeeping wrote the failure, then lost Redis before deleting the job
    of the acknowledged rollout; its retry (``JobEndings.books``) finds the job failed, no
    longer started by it, so not its to end: it must still delete it."""
    client = RolloutClient(server.url)
    sync = Redis.from_url(server.url)
    bridge = RqBridge(server.url, ["rollouts"], "w1")
    try:
        await bridge.register()
        (rid,) = await client.submit([f.request(4)], batch_id="b")
        (taken,) = await bridge.dequeue_many(1, 1)
        await _finish_rollout(client.store, rid)
        assert (await client.ack([rid])).acked == [rid]
        real_idle = bridge.rq_books.idle_if_empty
        lost = [ConnectionError("Redis went away")]

        def idle() -> None:
            if lost:
                raise lost.pop()
            real_idle()

        monkeypatch.setattr(bridge.rq_books, "idle_if_empty", idle)
        with pytest.raises(ConnectionError):
            await bridge.fail(taken, f"no rollout {rid!r}")
        assert sync.hget(taken.job.key, "status") == b"failed"

        await bridge.fail(taken, f"no rollout {rid!r}")  # the retry

        assert _rq_keys_of(sync, taken.job.id) == []
    finally:
        await bridge.close()
        await client.aclose()
        sync.close()
