"""Jobs a worker cannot run, in-process on a real redis-server: each is refused or given back
with a backoff and a log line, never requeued in a hot loop, and never left "started" in rq.
Shutdown stops every background loop within a bounded time, even one that loses its cancel."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import pytest
import redis.asyncio as aredis
from redis import Redis

from statemachine import Status, Submitted
from store import EventStore
from store.inspect import find_stuck
from store.leases import Leases
from store.queue import JOB_FUNC, enqueue_rollouts, rollout_queue
from store.redis_server import RedisServer
from tests import factories as f
from tests.damage import damage_event
from workers.engines.synthetic import SyntheticEngine
from workers.reaper import Reaper
from workers.rq_bridge import RqBridge
from workers.worker import Worker, WorkerConfig

pytestmark = pytest.mark.redis_server


async def _submit(store: EventStore, rid: str, n: int = 8, queue: str = "rollouts") -> None:
    await store.append(None, Submitted(rollout_id=rid, seq=1, request=f.request(n), queue=queue))


def _registries(sync: Redis, queue: str = "rollouts") -> dict[str, list[str]]:
    q = rollout_queue(sync, queue)
    return {
        "queued": q.job_ids,
        "started": q.started_job_registry.get_job_ids(),
        "failed": q.failed_job_registry.get_job_ids(),
        "finished": q.finished_job_registry.get_job_ids(),
        "canceled": q.canceled_job_registry.get_job_ids(),
    }


async def _run_for(worker: Worker, seconds: float) -> None:
    task = asyncio.create_task(worker.run())
    await asyncio.sleep(seconds)
    worker.request_stop()
    await asyncio.wait_for(task, 30)


async def test_unloadable_rollouts_are_refused_once_not_requeued_forever(
    server: RedisServer,
) -> None:
    client = aredis.Redis.from_url(server.url)
    sync = Redis.from_url(server.url)
    store = EventStore(client)
    await _submit(store, "ok")
    # "corrupt": an aborted rollout whose token record is damaged; its snapshot is readable.
    s = await store.append(None, f.submitted("corrupt", max_tokens=32))
    s = await store.append(s, f.started(s))
    s = await store.append(s, f.tokens(s))
    await store.append(s, f.aborted(s))
    await damage_event(client, store, "corrupt", 3)
    enqueue_rollouts(rollout_queue(sync), ["missing", "corrupt", "ok"])
    worker = Worker(WorkerConfig(redis_url=server.url, max_concurrency=2), SyntheticEngine())
    await _run_for(worker, 3.0)
    books = _registries(sync)
    # Before: each was requeued at once, forever (~300 requeues/s, on every worker).
    assert len(books["failed"]) == 1 and books["queued"] == books["started"] == []
    reasons = {
        rollout_queue(sync).fetch_job(j).kwargs["rollout_id"]: rollout_queue(sync).fetch_job(j)
        for j in books["failed"]
    }
    assert "checksum" in (reasons["corrupt"].exc_info or "")
    # The job of a rollout that does not exist (acknowledged, or never submitted) is refused
    # with why, then deleted: nothing of an acknowledged rollout stays in Redis (invariant 9).
    assert "missing" not in reasons
    left = [k.decode().removeprefix("rq:job:") for k in sync.keys("rq:job:*")]
    owners = {rollout_queue(sync).fetch_job(j).kwargs["rollout_id"] for j in left}
    assert "missing" not in owners and "corrupt" in owners
    assert worker.stats.outcomes["refused"] == 2
    # The damaged rollout ends (a waiting trainer sees it fail), the healthy one is done.
    assert await store.statuses(["corrupt"]) == [Status.FAILED]
    assert (await store.load("ok")).status is Status.DONE
    await client.aclose()


async def test_jobs_that_are_not_rollout_jobs_are_failed_before_taking_a_slot(
    server: RedisServer,
) -> None:
    client = aredis.Redis.from_url(server.url)
    sync = Redis.from_url(server.url)
    store = EventStore(client)
    queue = rollout_queue(sync)
    # Anyone with write access to Redis can enqueue these.
    no_id = queue.enqueue_call(JOB_FUNC, kwargs={})
    other_func = queue.enqueue_call("os.system", kwargs={"rollout_id": "x"})
    bad_id = queue.enqueue_call(JOB_FUNC, kwargs={"rollout_id": "{broken}"})
    garbage = queue.enqueue_call(JOB_FUNC, kwargs={"rollout_id": "y"})
    sync.hset(garbage.key, "data", b"not json at all")
    await _submit(store, "ok")
    enqueue_rollouts(queue, ["ok"])
    worker = Worker(
        WorkerConfig(redis_url=server.url, max_concurrency=1, burst=True), SyntheticEngine()
    )
    # Before: a job without rollout_id killed its task outside the try and left a zombie
    # execution, heartbeated forever, with `rq info` showing the worker busy.
    await asyncio.wait_for(worker.run(), 30)
    books = _registries(sync)
    assert sorted(books["failed"]) == sorted(j.id for j in (no_id, other_func, bad_id, garbage))
    assert books["started"] == [] and books["queued"] == []
    assert (await store.load("ok")).status is Status.DONE
    assert "os.system" in (rollout_queue(sync).fetch_job(other_func.id).exc_info or "")
    await client.aclose()


async def test_duplicate_and_fenced_out_jobs_are_superseded_not_successes(
    server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    client = aredis.Redis.from_url(server.url)
    sync = Redis.from_url(server.url)
    store = EventStore(client)
    # "held": live on another worker whose lease is current: this job is a duplicate.
    await _submit(store, "held", 32)
    s = await store.load("held")
    await store.append(s, f.started(s, worker="elsewhere"))
    await Leases(client).take("held", 60)
    enqueue_rollouts(rollout_queue(sync), ["held"])
    worker = Worker(
        WorkerConfig(redis_url=server.url, max_concurrency=1, burst=True), SyntheticEngine()
    )
    with caplog.at_level(logging.INFO, logger="rollouts"):
        await asyncio.wait_for(worker.run(), 30)
    books = _registries(sync)
    # Before: rq listed it as "Successfully completed" although it ran nothing.
    assert books["finished"] == [] and len(books["canceled"]) == 1
    assert any("held" in r.message and "superseded" in r.message for r in caplog.records)
    await client.aclose()


async def test_every_retry_failure_and_takeover_gets_a_log_line(
    server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    client = aredis.Redis.from_url(server.url)
    sync = Redis.from_url(server.url)
    store = EventStore(client)
    await store.append(None, f.submitted("poisoned", prompt=(1, 7, 2)))
    # "orphan": live on a worker that died without a lease: this worker takes it over.
    await _submit(store, "orphan")
    s = await store.load("orphan")
    await store.append(s, f.started(s, worker="dead-worker"))
    enqueue_rollouts(rollout_queue(sync), ["poisoned", "orphan"])
    worker = Worker(
        WorkerConfig(redis_url=server.url, burst=True, max_engine_attempts=2, name="w-log"),
        SyntheticEngine(poison_token=7),
    )
    with caplog.at_level(logging.INFO, logger="rollouts"):
        await asyncio.wait_for(worker.run(), 30)
    lines = [r.getMessage() for r in caplog.records]

    def one(*words: str) -> str:
        found = [m for m in lines if all(w in m for w in words)]
        assert found, f"no log line with {words}: {lines}"
        return found[0]

    # Before: engine errors, retries and failures logged nothing.
    one("rollout poisoned attempt 1", "engine error 1 of 2", "w-log", "retrying")
    one("rollout poisoned attempt 1", "aborted on w-log", "engine_error")
    one("rollout poisoned attempt 2", "failed after 2 engine errors", "w-log")
    one("rollout orphan attempt 1", "taking over from worker dead-worker")
    assert (await store.load("poisoned")).status is Status.FAILED
    assert (await store.load("orphan")).status is Status.DONE
    await client.aclose()


async def test_rq_bookkeeping_is_retried_through_an_outage(
    server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = aredis.Redis.from_url(server.url)
    sync = Redis.from_url(server.url)
    store = EventStore(client)
    await _submit(store, "r")
    enqueue_rollouts(rollout_queue(sync), ["r"])
    real_succeed = RqBridge.succeed
    calls = []

    async def flaky_succeed(self, r, result):  # type: ignore[no-untyped-def]
        # Redis unreachable past the client's own retries, twice.
        calls.append(1)
        if len(calls) <= 2:
            from redis.exceptions import ConnectionError as RedisConnectionError

            raise RedisConnectionError("Redis is down")
        await real_succeed(self, r, result)

    monkeypatch.setattr(RqBridge, "succeed", flaky_succeed)
    monkeypatch.setattr("store.defaults.REQUEUE_BACKOFF_S", 0.05)
    worker = Worker(WorkerConfig(redis_url=server.url, burst=True), SyntheticEngine())
    await asyncio.wait_for(worker.run(), 30)
    books = _registries(sync)
    # Before: the failed call killed the job's task and left it "started" with no heartbeat;
    # rq later failed it as abandoned although its rollout was done.
    assert len(calls) == 3
    assert len(books["finished"]) == 1 and books["started"] == books["failed"] == []
    assert (await store.load("r")).status is Status.DONE
    await client.aclose()


async def test_shutdown_is_bounded_when_a_loop_swallows_its_cancel(
    server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What redis-py 7.4 does now and then with socket_timeout set: a cancel delivered while a
    # command is in flight is lost, and the loop goes on. Before, the worker awaited the
    # cancelled loop forever.
    async def swallowing_pass(self: Reaper) -> list[str]:
        with contextlib.suppress(asyncio.CancelledError):  # lost, as inside redis-py
            await asyncio.sleep(0.05)
        return []

    monkeypatch.setattr(Reaper, "reap_once", swallowing_pass)
    worker = Worker(WorkerConfig(redis_url=server.url, reap_interval_s=0.01), SyntheticEngine())
    task = asyncio.create_task(worker.run())
    await asyncio.sleep(1.0)
    worker.request_stop()
    await asyncio.wait_for(task, 15)


async def test_a_rollout_with_an_expired_lease_is_not_reaped_onto_the_reapers_queue(
    server: RedisServer,
) -> None:
    # The repro in-process: a rollout of queue "qk" whose worker died; a worker of
    # queue "rollouts" reaps it, and must leave the work to qk's workers.
    client = aredis.Redis.from_url(server.url)
    sync = Redis.from_url(server.url)
    store = EventStore(client)
    await _submit(store, "dense-job", 32, queue="qk")
    s = await store.load("dense-job")
    await store.append(s, f.started(s, worker="dead", model="qwen3:dense"))
    leases = Leases(client)
    await client.zadd(leases.key, {"dense-job": (await leases.read()).now_ms - 1000})
    worker = Worker(WorkerConfig(redis_url=server.url, reap_interval_s=0.05), SyntheticEngine())
    await _run_for(worker, 2.0)
    state = await store.load("dense-job")
    assert state.status is Status.ABORTED and state.attempt == 1  # nobody here ran it
    assert len(_registries(sync, "qk")["queued"]) == 1
    assert _registries(sync)["queued"] == []
    await client.aclose()


async def test_a_job_on_the_wrong_queue_moves_to_the_rollouts_own_and_another_model_waits(
    server: RedisServer,
) -> None:
    client = aredis.Redis.from_url(server.url)
    sync = Redis.from_url(server.url)
    store = EventStore(client)
    await _submit(store, "for-qk", queue="qk")
    # "other-model": aborted after an attempt on another model; its job is on our queue.
    await _submit(store, "other-model", 32)
    s = await store.load("other-model")
    s = await store.append(s, f.started(s, worker="gone", model="qwen3_moe:elsewhere"))
    s = await store.append(s, f.tokens(s))
    await store.append(s, f.aborted(s))
    enqueue_rollouts(rollout_queue(sync), ["for-qk", "other-model"])
    worker = Worker(WorkerConfig(redis_url=server.url, max_concurrency=2), SyntheticEngine())
    await _run_for(worker, 2.5)
    assert len(_registries(sync, "qk")["queued"]) == 1
    assert (await store.load("for-qk")).status is Status.PENDING
    # qk is among rq's queues, so its job is seen (`rq info`, ``find_stuck``, the stranded
    # net): before, the stranded net could requeue for-qk a second time.
    assert rollout_queue(sync, "qk").key.encode() in sync.smembers("rq:queues")
    assert "for-qk" not in [s.rollout_id for s in await find_stuck(store, sync, recheck_s=0.1)]
    # Refused without a write, given back after a backoff (1 s, then 2 s): not a hot loop.
    other = await store.load("other-model")
    assert other.status is Status.ABORTED and other.attempt == 1
    assert 1 <= worker.stats.outcomes.get("wrong_model", 0) <= 3
    [job_id] = _registries(sync)["queued"]
    assert rollout_queue(sync).fetch_job(job_id).kwargs == {"rollout_id": "other-model"}
    await client.aclose()


@pytest.mark.slow  # a real Redis outage longer than the client's ~15 s of retries
async def test_registries_match_the_rollouts_after_a_long_redis_outage(
    server: RedisServer,
) -> None:
    client = aredis.Redis.from_url(server.url)
    store = EventStore(client)
    ids = [f"o{i}" for i in range(4)]
    for rid in ids:
        await _submit(store, rid, 200)
    enqueue_rollouts(rollout_queue(Redis.from_url(server.url)), ids)
    worker = Worker(
        WorkerConfig(redis_url=server.url, max_concurrency=4, lease_ttl_s=2.0, heartbeat_s=0.25,
                     reap_interval_s=0.2, rq_execution_ttl_s=3.0),
        SyntheticEngine(tokens_per_chunk=1, token_delay_s=0.02),
    )  # fmt: skip
    task = asyncio.create_task(worker.run())
    try:
        while (await store.load(ids[0])).num_tokens < 20:
            await asyncio.sleep(0.05)
        await asyncio.to_thread(server.stop)  # SIGTERM: the AOF keeps what was acknowledged
        await asyncio.sleep(20)  # longer than the clients' own retries
        await asyncio.to_thread(server.start)
        await client.aclose()
        client = aredis.Redis.from_url(server.url)
        store = EventStore(client)
        deadline = asyncio.get_running_loop().time() + 120
        while True:
            states = await store.statuses(ids)
            books = _registries(Redis.from_url(server.url))
            settled = books["started"] == books["queued"] == []
            if all(s is Status.DONE for s in states) and settled:
                break
            assert asyncio.get_running_loop().time() < deadline, (states, books)
            await asyncio.sleep(0.2)
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, 60)
    # Before: a job whose bookkeeping failed in the outage stayed "started" with nobody on it,
    # and rq later failed it as abandoned although its rollout was done.
    assert books["failed"] == []
    assert len(books["finished"]) >= len(ids)  # duplicates of a job are canceled, not failed
    for rid in ids:
        assert await store.load(rid) == await store.replay(rid)
    await client.aclose()
