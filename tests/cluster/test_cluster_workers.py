"""Workers generating with the event store on a real Redis Cluster (3 masters, 3 replicas)
and rq's queue on a redis-server of its own: every rollout ends once with the tokens of an
uninterrupted run, spread over every master."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from redis import Redis
from redis.asyncio.cluster import RedisCluster as ClusterClient

from statemachine import Aborted, Finished, Membership, RolloutRequest, Started, Status
from store import cluster_appends
from store.client import RolloutClient
from store.event_store import EventStore
from store.redis_cluster import RedisCluster
from store.redis_server import RedisServer
from tests import factories as f
from tests.cluster.test_cluster_trainer import every_key
from tests.ops.test_ops_cli import cli
from tests.workers.helpers import (
    SYNTHETIC,
    direct_greedy,
    greedy,
    random_prompts,
    start_worker,
    stop,
    until,
)
from workers.engines.synthetic import SyntheticEngine
from workers.outbox_sweep import OutboxSweep
from workers.worker import Worker, WorkerConfig

pytestmark = pytest.mark.redis_server


@pytest.fixture
def queue_url(redis_server: RedisServer) -> str:
    """rq's queue on the session's redis-server, emptied for the test."""
    with Redis.from_url(redis_server.url) as r:
        r.flushall()
    return redis_server.url


async def _submit(store: EventStore, url: str, queue_url: str, reqs: list[RolloutRequest],
                  batch: str) -> list[str]:  # fmt: skip
    """Submitted as a trainer submits, by the client on the cluster (its queue apart)."""
    client = RolloutClient(url, queue_url=queue_url)
    try:
        return list(await client.submit(reqs, batch_id=batch))
    finally:
        await client.aclose()


@pytest.fixture
async def worker_task(
    cluster: RedisCluster, cluster_client: ClusterClient, queue_url: str
) -> AsyncIterator[Worker]:
    config = WorkerConfig(redis_url=cluster.url, queue_url=queue_url, name="w",
                          max_concurrency=4)  # fmt: skip
    worker = Worker(config, SyntheticEngine(tokens_per_chunk=4, token_delay_s=0.001))
    task = asyncio.create_task(worker.run())
    yield worker
    worker.request_stop()
    await asyncio.wait_for(task, 60)


async def test_a_worker_generates_across_the_cluster(
    store: EventStore, cluster: RedisCluster, cluster_client: ClusterClient, queue_url: str,
    worker_task: Worker,
) -> None:  # fmt: skip
    reqs = [RolloutRequest(prompt_token_ids=p, sampling=greedy(40))
            for p in random_prompts(12, seed=3, length=5)]  # fmt: skip
    ids = await _submit(store, cluster.url, queue_url, reqs, "cw")

    async def all_done() -> bool:
        states = [await store.head(rid) for rid in ids]
        return all(s.status is Status.DONE for s in states)

    await until(all_done, timeout=120, what="the rollouts never ended")
    await _check_exact(store, ids, reqs)
    for rid in ids:
        kinds = [type(e) for e in await store.events(rid)]
        assert kinds.count(Started) == 1, (rid, kinds)
    # The trainer's side: results as they came, then acknowledged, leaving nothing of the
    # batch on any master (the fleet's own keys stay: counters, heartbeats, tokens) and no
    # job on the queue.
    client = RolloutClient(cluster.url, queue_url=queue_url)
    results = await client.wait(ids, timeout=30)
    want = await direct_greedy(None, SYNTHETIC, [r.prompt_token_ids for r in reqs],
                               reqs[0].sampling)  # fmt: skip
    for r, (tokens, _) in zip(results, want, strict=True):
        np.testing.assert_array_equal(r.response_token_ids, tokens)
    assert sorted((await client.ack(batch_id="cw")).acked) == sorted(ids)
    left = await every_key(cluster_client)
    assert {k for k in left if b"cw" in k} == set(), left
    with Redis.from_url(queue_url) as q:
        assert q.keys("rq:job:*") == []
    await client.aclose()


async def test_a_worker_sigkilled_on_the_cluster_is_taken_over_and_every_rollout_is_exact(
    store: EventStore, cluster: RedisCluster, queue_url: str, tmp_path: Path
) -> None:
    # a runs two rollouts slowly and is SIGKILLed once it saved tokens of both; b, watching
    # presence on the queue's Redis, gives them back (the lease on its index, the job's id on
    # the snapshot in the rollout's slot, the job on the queue) and runs everything.
    reqs = [RolloutRequest(prompt_token_ids=p, sampling=greedy(48))
            for p in random_prompts(6, seed=5, length=5)]  # fmt: skip
    ids = await _submit(store, cluster.url, queue_url, reqs, "ck")
    extra = ("--lease-ttl", "2", "--heartbeat", "0.25", "--queue-redis", queue_url)
    a = start_worker(cluster.url, SYNTHETIC, "a", tmp_path / "a.log", *extra, concurrency=2,
                     synthetic={"token_delay_s": 0.05})  # fmt: skip
    b = None
    try:
        await until(lambda: _saving(store, ids, 2), what="worker a never saved")
        a.send_signal(signal.SIGKILL)
        a.wait(10)
        b = start_worker(cluster.url, SYNTHETIC, "b", tmp_path / "b.log", *extra, concurrency=4,
                         synthetic={"token_delay_s": 0.0})  # fmt: skip
        await until(lambda: _all_done(store, ids), timeout=120, what="the rollouts never ended")
    finally:
        stop(a, *([b] if b else []))
    await _check_exact(store, ids, reqs)
    aborts = [sum(isinstance(e, Aborted) for e in await store.events(rid)) for rid in ids]
    assert sorted(aborts) == [0, 0, 0, 0, 1, 1]  # a's two, given back once each


async def test_one_reaper_per_interval_sweeps_the_outboxes(
    store: EventStore, cluster_client: ClusterClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An appender died between the end and its delivery: the sweep's token winner delivers
    # it (once), a second sweep in the same interval does nothing.
    s = await store.append(None, replace(f.submitted("ob.0.0"),
                                         membership=Membership(batch_id="ob")))  # fmt: skip
    s = await store.append(s, f.started(s))

    async def dies(*args: object, **kwargs: object) -> None:
        raise ConnectionError("the appender died here")

    monkeypatch.setattr(cluster_appends, "deliver", dies)
    await store.append(s, f.finished(s))
    old = -60_000  # every entry counts as old enough at once
    first = OutboxSweep(store, worker_id="r1", older_than_ms=old)
    second = OutboxSweep(store, worker_id="r2", older_than_ms=old)
    assert await first.check() == 1
    assert await second.check() == 0  # the interval's token is r1's
    [(_, fields)] = await cluster_client.xrange(store.keys.completions("ob"))
    assert fields == {b"r": b"ob.0.0", b"s": b"done"}


async def _saving(store: EventStore, ids: list[str], n: int) -> bool:
    states = [await store.head(rid) for rid in ids]
    return sum(s.status is Status.GENERATING and s.num_tokens >= 8 for s in states) == n


async def _all_done(store: EventStore, ids: list[str]) -> bool:
    states = [await store.head(rid) for rid in ids]
    return all(s.status is Status.DONE for s in states)


async def _check_exact(store: EventStore, ids: list[str], reqs: list[RolloutRequest]) -> None:
    """Each rollout done once, with the tokens of an uninterrupted run."""
    want = await direct_greedy(None, SYNTHETIC, [r.prompt_token_ids for r in reqs],
                               reqs[0].sampling)  # fmt: skip
    for rid, (tokens, logprobs) in zip(ids, want, strict=True):
        s = await store.load(rid)
        np.testing.assert_array_equal(s.token_ids, tokens)
        np.testing.assert_allclose(s.logprobs, logprobs)
        kinds = [type(e) for e in await store.events(rid)]
        assert kinds.count(Finished) == 1, (rid, kinds)


async def test_the_operator_commands_on_the_cluster_rebuild_a_lost_queue(
    store: EventStore, cluster: RedisCluster, queue_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # The queue's Redis emptied under four waiting rollouts: `stuck` finds each with no job
    # (a scan of the snapshots on every master), `requeue --all-waiting` gives each one job
    # (its id on the snapshot in the rollout's slot, the job on the queue), `status` reads the
    # counters summed over the slots, and a worker then runs every one exactly.
    reqs = [RolloutRequest(prompt_token_ids=p, sampling=greedy(24))
            for p in random_prompts(4, seed=9, length=5)]  # fmt: skip
    ids = await _submit(store, cluster.url, queue_url, reqs, "ops")
    with Redis.from_url(queue_url) as q:
        q.flushdb()
    where = ("--redis", cluster.url, "--queue-redis", queue_url)
    code, out, err = await cli(capsys, "stuck", "--json", *where)
    assert code == 0, err
    assert out.count('"no_job"') == len(ids)
    code, out, err = await cli(capsys, "requeue", "--all-waiting", *where)
    assert code == 0, err
    assert out.splitlines()[-1] == f"requeued {len(ids)} waiting rollouts"
    code, out, err = await cli(capsys, "status", "--json", *where)
    assert code == 0, err
    status = json.loads(out)
    assert status["rollouts"]["pending"] == len(ids) and status["queues"] == {"rollouts": len(ids)}
    assert status["store"]["writable"]
    config = WorkerConfig(redis_url=cluster.url, queue_url=queue_url, name="w", max_concurrency=4)
    worker = Worker(config, SyntheticEngine(tokens_per_chunk=4, token_delay_s=0.001))
    task = asyncio.create_task(worker.run())
    try:
        await until(lambda: _all_done(store, ids), timeout=60, what="the rollouts never ended")
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, 60)
    await _check_exact(store, ids, reqs)
    code, out, _ = await cli(capsys, "stuck", *where)
    assert (code, out) == (0, "no stuck rollouts\n")
