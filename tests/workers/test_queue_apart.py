"""rq's queue on a Redis of its own (``--queue-redis``, store/queue_redis.py), with real worker
processes on two real redis-servers: every rollout finishes once with the tokens of an
uninterrupted run, a worker SIGKILLed mid-run is seen gone through presence on the queue's
Redis and its rollouts are given back in ordered steps, rq's keys never land on the store's
Redis nor the store's on the queue's, and the queue's Redis lost outright (killed, its data
deleted, started empty) is rebuilt from the store by `rollouts requeue --all-waiting`.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis import Redis

from statemachine import FinishReason, Status
from store.client import RolloutClient
from store.event_store import JOB
from store.redis_server import RedisServer
from tests.ops.test_ops_cli import cli, run_cli
from tests.ops.test_requeue import _check_ran_once, _generating, _requests
from tests.workers.episode_helpers import environment
from tests.workers.helpers import SYNTHETIC, start_worker, stop, until
from tests.workers.test_episode_processes import TURNS, VOCAB, _long_second_turn
from workers.engines.synthetic import SyntheticEngine
from workers.worker import Worker, WorkerConfig

pytestmark = pytest.mark.redis_server

FAST = ("--lease-ttl", "2", "--heartbeat", "0.25")


@pytest.fixture
def queue_server(tmp_path: Path) -> Iterator[RedisServer]:
    """The queue's own redis-server, beside the store's (``server``)."""
    with RedisServer(tmp_path / "queue-redis") as s:
        yield s


def _keys(conn: Redis) -> list[str]:
    return sorted(k.decode() for k in conn.scan_iter(count=1000))


def _check_apart(store: Redis, queue: Redis) -> None:
    """No rq key on the store's Redis; on the queue's, only rq's keys and what lives with them
    (the fleet's presence, the workers' affinity hints)."""
    assert [k for k in _keys(store) if k.startswith("rq:")] == []
    queue_side = ("rq:", "dr:presence", "dr:worker:")
    assert [k for k in _keys(queue) if not k.startswith(queue_side)] == []


@pytest.mark.slow  # waits out rq's execution TTL (15 s) for a dead worker's jobs
async def test_workers_with_the_queue_apart_survive_a_sigkill_and_keep_the_keys_apart(
    server: RedisServer, queue_server: RedisServer, tmp_path: Path
) -> None:
    url, qurl = server.url, queue_server.url
    client = RolloutClient(url, queue_url=qurl)
    store, queue = Redis.from_url(url), Redis.from_url(qurl)
    reqs = _requests(6, 48)
    ids = await client.submit(reqs, batch_id="apart")
    assert queue.llen("rq:queue:rollouts") == len(ids)
    _check_apart(store, queue)
    # a runs two rollouts slowly and is SIGKILLed once it saved tokens of both; b, watching
    # presence on the queue's Redis, sees its connection close and gives them back.
    # Leases of a minute: only presence can give a's rollouts back within the test's time.
    slow_leases = ("--lease-ttl", "60", "--heartbeat", "0.25", "--queue-redis", qurl)
    a = start_worker(url, SYNTHETIC, "a", tmp_path / "a.log", *slow_leases, concurrency=2,
                     synthetic={"token_delay_s": 0.05})  # fmt: skip
    b = None
    try:
        await until(lambda: _two_generating(client, ids), what="worker a never saved")
        live = await _generating(client, ids, 8)
        b = start_worker(url, SYNTHETIC, "b", tmp_path / "b.log", *slow_leases,
                         concurrency=4, synthetic={"token_delay_s": 0.0})  # fmt: skip
        await until(lambda: _in_stats(client, "b"), what="worker b never started")
        a.send_signal(signal.SIGKILL)
        a.wait(10)
        await _check_ran_once(client, reqs, ids, set(live), timeout=30)
        assert "worker a: its process is gone" in (tmp_path / "b.log").read_text()
        _check_apart(store, queue)
        report = await client.ack(ids)
        assert sorted(report.acked) == sorted(ids)
        # Nothing of the acknowledged rollouts stays on either Redis. Their jobs go with them,
        # but for a's two, which rq still lists as started by a: ack leaves a started job to
        # its worker. Once their executions lapse (15 s unbeaten), b's sweep takes them back
        # and, finding their rollouts gone on the store, deletes them.
        jobs = [k for k in _keys(queue) if k.startswith("rq:job:")]
        assert [queue.hmget(k, "status", "worker_name") for k in jobs] == [[b"started", b"a"]] * 2
        await until(lambda: _no_jobs(queue), timeout=60, what="a's jobs were never swept")
        assert [k for k in _keys(store) if ":apart." in k] == []
    finally:
        stop(a, *([b] if b else []))
    store.close()
    queue.close()
    await client.aclose()


async def _in_stats(client: RolloutClient, worker: str) -> bool:
    return worker in {w.worker_id for w in (await client.stats()).workers}


async def _no_jobs(queue: Redis) -> bool:
    return not [k for k in _keys(queue) if k.startswith("rq:job:")]


async def _two_generating(client: RolloutClient, ids: list[str]) -> bool:
    return len(await _generating(client, ids, 8)) == 2


def _lose(queue_server: RedisServer) -> None:
    """The queue's Redis lost outright: SIGKILLed, its data deleted, started again empty."""
    queue_server.stop(kill=True)
    for item in queue_server.data_dir.iterdir():
        if item.name != "redis.log":
            shutil.rmtree(item) if item.is_dir() else item.unlink()
    queue_server.start()


async def test_the_queues_redis_lost_is_rebuilt_from_the_store(
    server: RedisServer, queue_server: RedisServer, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    url, qurl = server.url, queue_server.url
    client = RolloutClient(url, queue_url=qurl)
    reqs = _requests(4, 64)
    ids = await client.submit(reqs, batch_id="lost")
    # 50 ms a token: the two rollouts it runs generate for ~3 s, the other two wait.
    w = start_worker(url, SYNTHETIC, "w", tmp_path / "w.log", *FAST, "--queue-redis", qurl,
                     concurrency=2, synthetic={"token_delay_s": 0.05})  # fmt: skip
    try:
        await until(lambda: _two_generating(client, ids), what="worker w never saved")
        live = await _generating(client, ids, 8)
        _lose(queue_server)
        queue = Redis.from_url(qurl)
        assert queue.llen("rq:queue:rollouts") == 0
        # The operator's command, in a process of its own: the waiting two get a job each,
        # listed on their snapshots on the store; the live two are left to their worker.
        done = run_cli("requeue", "--all-waiting", "--redis", url, "--queue-redis", qurl)
        assert done.returncode == 0, done.stderr
        *lines, summary = done.stdout.splitlines()
        waiting = sorted(set(ids) - set(live))
        assert sorted(line.split()[1] for line in lines) == waiting, done.stdout
        assert summary == "requeued 2 waiting rollouts"
        # Not the queue's length: on a loaded machine the live two may have ended already and
        # the worker taken the new jobs at once. That the waiting two ran (below) shows them.
        store = Redis.from_url(url)
        for rid in waiting:
            listed = store.hget(client.keys.snapshot(rid), JOB)
            assert listed is not None and len(listed.split()) == 2  # the submit's, the new one
        await _check_ran_once(client, reqs, ids, set())
        code, out, _ = await cli(capsys, "stuck", "--redis", url, "--queue-redis", qurl)
        assert (code, out) == (0, "no stuck rollouts\n")
        statuses = {(await client.store.head(rid)).status for rid in ids}
        assert statuses == {Status.DONE}
        store.close()
        queue.close()
    finally:
        stop(w)
    await client.aclose()


async def test_with_no_operator_the_stranded_net_rebuilds_a_lost_queue_apart(
    server: RedisServer, queue_server: RedisServer
) -> None:
    # The net's shortfall reads the counters on the store and the jobs on the queue's Redis:
    # with every job gone it scans and requeues the waiting rollouts (store first, then the
    # queue); the one generating finishes where it runs.
    url, qurl = server.url, queue_server.url
    client = RolloutClient(url, queue_url=qurl)
    reqs = _requests(4, 48)
    ids = await client.submit(reqs, batch_id="net")
    config = WorkerConfig(redis_url=url, queue_url=qurl, name="w", max_concurrency=1,
                          stranded_check_s=0.2)  # fmt: skip
    worker = Worker(config, SyntheticEngine(tokens_per_chunk=1, token_delay_s=0.02))
    task = asyncio.create_task(worker.run())
    queue = Redis.from_url(qurl)
    try:
        await until(lambda: _one_generating(client, ids), what="the worker never saved")
        queue.flushall()
        await _check_ran_once(client, reqs, ids, set())
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, 60)
    assert worker.reaper is not None and worker.reaper.stranded is not None
    assert worker.reaper.stranded.requeued == len(ids) - 1  # all but the live one
    queue.close()
    await client.aclose()


async def _one_generating(client: RolloutClient, ids: list[str]) -> bool:
    return len(await _generating(client, ids, 8)) == 1


async def test_an_episodes_next_turns_go_onto_the_queue_apart(
    server: RedisServer, queue_server: RedisServer
) -> None:
    # Each tool result records its next turn's job id on the store, in the result's own
    # transaction, and the job is pushed onto the queue's Redis once it landed: every turn
    # runs, and the episode equals the same episode run uninterrupted.
    url, qurl = server.url, queue_server.url
    request, context, mask = await _long_second_turn()
    client = RolloutClient(url, queue_url=qurl)
    [rid] = await client.submit([request])
    config = WorkerConfig(redis_url=url, queue_url=qurl, name="w", max_concurrency=1)
    worker = Worker(config, SyntheticEngine(vocab=VOCAB, token_delay_s=0.0))
    task = asyncio.create_task(worker.run())
    try:
        async with environment(client, qurl):
            [result] = await client.wait([rid], timeout=60)
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, 60)
    state = await client.store.load(rid)
    assert result.status is Status.DONE and state.finish_reason is FinishReason.MAX_TURNS
    assert state.context_token_ids.tolist() == context
    assert state.loss_mask.tolist() == mask
    # The submit's job and one per later turn, all listed on the snapshot (its ack deletes
    # them), none left on the store's Redis.
    store, queue = Redis.from_url(url), Redis.from_url(qurl)
    assert len(store.hget(client.keys.snapshot(rid), JOB).split()) == TURNS  # type: ignore[union-attr]
    _check_apart(store, queue)
    store.close()
    queue.close()
    await client.aclose()
