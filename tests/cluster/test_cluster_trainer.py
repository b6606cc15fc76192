"""The trainer API on a store on Redis Cluster, its queue on one Redis (``RolloutClient(
"redis+cluster://...", queue_url="redis://...")``, ``rollouts api --redis redis+cluster://...
--queue-redis redis://...``): submit, results, groups, cancel, ack, stats and replica
acknowledgement, every step within one slot. The shared 3+3 cluster and the session's
redis-server as the queue; rollouts are ended as a worker would, through the cluster
EventStore (``tests.store.trainer.finish``)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import redis.asyncio as aredis
from aiohttp.test_utils import TestClient, TestServer
from redis.asyncio.cluster import RedisCluster as ClusterClient

from statemachine import RolloutRequest, SamplingParams, Status
from store import cluster_appends
from store import stats as stats_mod
from store.api.app import make_app
from store.client import RolloutClient
from store.cluster_appends import ClusterUnsupported
from store.errors import InvalidRedisUrl, ReplicasNotAcked
from store.redis_cluster import RedisCluster
from store.redis_server import RedisServer, free_port
from store.stats import WorkerBeat
from tests.api.test_process import api_command, wait_healthy
from tests.store.trainer import finish

QUEUE_LIST = b"rq:queue:rollouts"


def request(max_tokens: int = 8) -> RolloutRequest:
    return RolloutRequest(
        prompt_token_ids=(1, 2, 3), sampling=SamplingParams(max_tokens=max_tokens)
    )


@pytest.fixture
async def queue(redis_server: RedisServer) -> AsyncIterator[aredis.Redis]:
    q = aredis.Redis.from_url(redis_server.url)
    await q.flushdb()
    yield q
    await q.aclose()


@pytest.fixture
async def client(
    cluster: RedisCluster, cluster_client: ClusterClient, redis_server: RedisServer,
    queue: aredis.Redis,
) -> AsyncIterator[RolloutClient]:  # fmt: skip
    c = RolloutClient(cluster.url, queue_url=redis_server.url)
    yield c
    await c.aclose()


async def every_key(cluster_client: ClusterClient) -> set[bytes]:
    """Every key on every master, each master asked on its own."""
    found: set[bytes] = set()
    for node in cluster_client.get_primaries():
        found |= set(await cluster_client.keys("*", target_nodes=node))  # type: ignore[arg-type]
    return found


def test_a_cluster_store_needs_the_queue_apart(cluster: RedisCluster) -> None:
    with pytest.raises(InvalidRedisUrl, match="needs the queue on one Redis"):
        RolloutClient(cluster.url)


async def test_submit_records_per_slot_and_pushes_each_job_once(
    client: RolloutClient, cluster_client: ClusterClient, queue: aredis.Redis
) -> None:
    assert client.store.cluster and client.keys.grouped
    batch = await client.submit([request(), request(4), request()], n=2, batch_id="b1")
    assert batch == [f"b1.{g}.{s}" for g in range(3) for s in range(2)] and batch.fresh
    assert await queue.llen(QUEUE_LIST) == 6
    assert not [k for k in await every_key(cluster_client) if k.startswith(b"rq:")]
    again = await client.submit([request(), request(4), request()], n=2, batch_id="b1")
    assert again == batch and not again.fresh
    assert await queue.llen(QUEUE_LIST) == 6 and len(await queue.keys("rq:job:*")) == 6
    assert await client.statuses(batch) == ["pending"] * 6
    info = await client.batch("b1")
    assert (info.groups, info.group_size) == (3, 2)
    assert await client.batches() == ["b1"]
    named = await client.submit([request(), request()], ids=["x-1", "x-2"], batch_id="named")
    assert named == ["x-1", "x-2"]
    await client.submit([request(), request()], ids=["x-1", "x-2"], batch_id="named")
    assert await queue.llen(QUEUE_LIST) == 8
    stats = await client.stats()
    assert stats.by_state[Status.PENDING] == 8 and stats.queues == {"rollouts": 8}


async def test_a_submit_lost_before_its_queue_step_is_repaired_by_its_retry(
    client: RolloutClient, queue: aredis.Redis
) -> None:
    batch = await client.submit([request()], n=3, batch_id="lost")
    await queue.flushdb()  # as if the first try died between its store and queue steps
    await client.submit([request()], n=3, batch_id="lost")
    assert await queue.llen(QUEUE_LIST) == 3
    assert len(batch) == 3


async def test_results_wait_and_groups_are_what_was_appended(client: RolloutClient) -> None:
    batch = await client.submit([request(), request()], n=2, batch_id="r")
    ended = {rid: await finish(client.store, rid, n=3 + i) for i, rid in enumerate(batch)}
    results = [r async for r in client.results("r", timeout=10)]
    assert sorted(r.rollout_id for r in results) == sorted(batch)
    for r in results:
        n = ended[r.rollout_id].num_tokens
        assert r.status is Status.DONE and r.response_token_ids.tolist() == list(range(10, 10 + n))
        assert r.position  # an entry of the batch's stream, delivered through the outbox
    waited = await client.wait(batch, timeout=10)
    assert [r.rollout_id for r in waited] == batch
    assert [len(r.response_token_ids) for r in waited] == [3, 4, 5, 6]
    groups = [g async for g in client.groups("r", timeout=10)]
    assert sorted(g.group_index for g in groups) == [0, 1]
    assert all(len(g.results) == 2 for g in groups)
    resumed = [r async for r in client.results("r", after=results[1].position, timeout=10)]
    assert [r.rollout_id for r in resumed] == [r.rollout_id for r in results[2:]]


async def test_cancel_by_ids_and_a_whole_batch(client: RolloutClient) -> None:
    batch = await client.submit([request(), request(), request()], n=2, batch_id="c")
    await finish(client.store, batch[0])
    assert await client.cancel([batch[1]]) == [batch[1]]
    cancelled = await client.cancel(batch_id="c")
    assert sorted(cancelled) == sorted(batch[2:])
    assert await client.statuses(batch) == ["done"] + ["cancelled"] * 5
    results = [r async for r in client.results("c", timeout=10)]
    assert len(results) == 6  # every end delivered to the batch's stream
    stats = await client.stats()
    assert stats.by_state[Status.CANCELLED] == 5 and stats.by_state[Status.DONE] == 1
    assert stats.by_state[Status.PENDING] == 0


async def test_ack_leaves_nothing_of_its_rollouts_on_any_master(
    client: RolloutClient, cluster_client: ClusterClient, queue: aredis.Redis
) -> None:
    batch = await client.submit([request(), request(), request()], n=2, batch_id="a")
    before = await every_key(cluster_client)
    for rid in batch[:4]:
        await finish(client.store, rid)
    report = await client.ack([*batch[:3], "a.2.1"])
    assert report.acked == batch[:3] and report.live == ["a.2.1"]
    keys = client.keys
    left = await every_key(cluster_client)
    for rid in batch[:3]:
        assert not {k.encode() for k in keys.rollout(rid)} & left
    cids = await cluster_client.hkeys(keys.completion_ids("a"))
    assert cids == [batch[3].encode()]  # the one ended and not acknowledged
    stream = await cluster_client.xrange(keys.completions("a"))
    assert [f[b"r"].decode() for _, f in stream] == [batch[3]]
    assert await queue.llen(QUEUE_LIST) == 6  # nothing took them: their hashes go, ids stay
    assert len(await queue.keys("rq:job:*")) == 3
    again = await client.ack(batch[:3])
    assert again.missing == batch[:3]
    for rid in batch[4:]:
        await client.cancel([rid])
    whole = await client.ack(batch_id="a")
    assert sorted(whole.acked) == sorted(batch[3:])
    assert await queue.keys("rq:job:*") == []
    # Only the per-slot counters stay (deployment-wide, as dr:stats on one Redis), and the
    # outboxes are empty: nothing names a rollout of the batch.
    gone = await every_key(cluster_client)
    assert {k for k in gone if not k.startswith(b"dr:stats:")} == set(), gone
    assert {k for k in before if not k.startswith(b"dr:stats:")}  # there were some
    assert await client.batches() == []


async def test_an_ended_rollout_left_in_its_outbox_is_delivered_then_acknowledged(
    client: RolloutClient, cluster_client: ClusterClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    [rid] = await client.submit([request()], batch_id="o")

    async def dropped(*_: object, **__: object) -> None:  # the appender died after its append
        return None

    monkeypatch.setattr(cluster_appends, "deliver_ended", dropped)
    await finish(client.store, rid)
    assert await cluster_client.xlen(client.keys.completions("o")) == 0
    assert (await client.ack([rid])).acked == [rid]
    left = await every_key(cluster_client)
    assert {k for k in left if not k.startswith(b"dr:stats:")} <= {
        client.keys.batch("o").encode(), b"dr:batches",
        client.keys.completions("o").encode(),
    }  # fmt: skip
    assert await cluster_client.xlen(client.keys.completions("o")) == 0


async def test_stats_sum_the_slots_and_the_workers_beat_and_are_pruned(
    client: RolloutClient,
) -> None:
    batch = await client.submit([request()] * 4, n=4, batch_id="s")
    for rid in batch[:5]:
        await finish(client.store, rid, n=2)
    beat = WorkerBeat("w1", in_flight=0, weight_version=0, queues=("rollouts",), model="m")
    assert await stats_mod.beat(client.redis, client.keys, beat) is None
    old = WorkerBeat("w2", 0, 0, ("rollouts",), "m", at=1.0)
    await stats_mod.beat(client.redis, client.keys, old)
    stats = await client.stats()
    assert stats.by_state[Status.DONE] == 5 and stats.by_state[Status.PENDING] == 11
    assert stats.tokens == 10 and stats.queues == {"rollouts": 16}
    assert [w.worker_id for w in stats.workers] == ["w1"]
    assert await stats_mod.prune(client.redis, client.keys) == ["w2"]
    await stats_mod.remove(client.redis, client.keys, "w1")
    assert (await client.stats()).workers == []


async def test_replica_acks_confirm_every_master(
    cluster: RedisCluster, cluster_client: ClusterClient, redis_server: RedisServer,
    queue: aredis.Redis,
) -> None:  # fmt: skip
    acked = RolloutClient(cluster.url, queue_url=redis_server.url, min_replicas_acked=1)
    greedy = RolloutClient(cluster.url, queue_url=redis_server.url, min_replicas_acked=2)
    try:
        batch = await acked.submit([request()] * 8, n=2, batch_id="w")
        for rid in batch:
            await finish(acked.store, rid)
        assert len((await acked.ack(batch_id="w")).acked) == 16
        # One replica per master: two are never confirmed, whichever master is asked.
        with pytest.raises(ReplicasNotAcked, match="of 2 replicas"):
            await greedy.submit([request()], batch_id="w2")
        # Applied on the masters all the same: its retry is recognised, nothing is added.
        with pytest.raises(ReplicasNotAcked):
            await greedy.submit([request()], batch_id="w2")
        assert len(await queue.keys("rq:job:*")) == 1  # the acknowledged ones' are gone
    finally:
        await acked.aclose()
        await greedy.aclose()


async def test_sessions_and_episodes_are_refused_before_anything_is_written(
    client: RolloutClient, cluster_client: ClusterClient, queue: aredis.Redis
) -> None:
    with pytest.raises(ClusterUnsupported, match="sessions"):
        await client.submit([request()], session="s1", batch_id="sess")
    for call in (client.session("s1"), client.trajectory("s1"), client.ack(session="s1"),
                 client.cancel(session="s1")):  # fmt: skip
        with pytest.raises(ClusterUnsupported):
            await call
    assert await every_key(cluster_client) == set() and await queue.dbsize() == 0


@pytest.fixture
async def api(client: RolloutClient) -> AsyncIterator[TestClient]:
    tc = TestClient(TestServer(make_app(client)))
    await tc.start_server()
    yield tc
    await tc.close()


async def test_the_http_api_on_a_cluster(
    api: TestClient, client: RolloutClient, cluster_client: ClusterClient, queue: aredis.Redis
) -> None:
    assert (await api.get("/healthz")).status == 200
    body = {"prompts": [{"prompt_token_ids": [1, 2, 3]}] * 2, "n": 2,
            "sampling": {"max_tokens": 4}, "batch_id": "h"}  # fmt: skip
    r = await api.post("/v1/batches", json=body)
    assert r.status == 200, await r.text()
    ids = (await r.json())["ids"]
    assert len(ids) == 4 and await queue.llen(QUEUE_LIST) == 4
    for rid in ids[:3]:
        await finish(client.store, rid)
    r = await api.post("/v1/cancel", json={"ids": [ids[3]]})
    assert (await r.json())["cancelled"] == [ids[3]]
    r = await api.get("/v1/batches/h/results", params={"timeout": "10"})
    lines = [line for line in (await r.text()).splitlines() if line]
    assert r.status == 200 and len(lines) == 4
    stats = await (await api.get("/v1/stats")).json()
    assert stats["queues"] == {"rollouts": 4}
    r = await api.post("/v1/ack", json={"batch_id": "h"})
    assert sorted((await r.json())["acked"]) == sorted(ids)
    assert await queue.keys("rq:job:*") == []
    assert {k for k in await every_key(cluster_client) if not k.startswith(b"dr:stats:")} == set()
    r = await api.post("/v1/cancel", json={"session": "s"})
    assert r.status == 501, await r.text()
    error = (await r.json())["error"]
    assert error["type"] == "cluster_unsupported" and "sessions" in error["message"]
    assert (await api.get("/v1/sessions/s")).status == 501


async def test_healthz_asks_every_master_and_names_the_one_that_refuses(
    api: TestClient, cluster: RedisCluster, cluster_client: ClusterClient
) -> None:
    masters = cluster_client.get_primaries()
    last = masters[-1]
    await cluster_client.config_set("maxmemory", "1", target_nodes=last)  # type: ignore[arg-type]
    try:
        r = await api.get("/healthz")
        body = await r.json()
        assert r.status == 503 and body["reason"] == "oom", body
        assert last.name in body["redis"]
    finally:
        await cluster_client.config_set("maxmemory", "0", target_nodes=last)  # type: ignore[arg-type]
    assert (await api.get("/healthz")).status == 200


async def test_a_real_api_process_on_a_cluster(
    cluster: RedisCluster, cluster_client: ClusterClient, redis_server: RedisServer,
    queue: aredis.Redis, tmp_path: Path,
) -> None:  # fmt: skip
    refused = subprocess.run(api_command(cluster.url, free_port()), capture_output=True,
                             text=True, timeout=60, check=False)  # fmt: skip
    assert refused.returncode == 2 and "needs the queue on one Redis" in refused.stderr
    port = free_port()
    log = tmp_path / "api.log"
    api = subprocess.Popen(api_command(cluster.url, port, "--queue-redis", redis_server.url),
                           stdout=log.open("wb"), stderr=subprocess.STDOUT)  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}"
        await wait_healthy(base, api, log)
        body = {"prompts": [{"prompt_token_ids": [1, 2]}], "n": 3,
                "sampling": {"max_tokens": 4}, "batch_id": "p"}  # fmt: skip
        async with (
            aiohttp.ClientSession(base_url=base) as http,
            http.post("/v1/batches", json=body) as r,
        ):
            assert r.status == 200, await r.text()
            assert len((await r.json())["ids"]) == 3
        assert await queue.llen(QUEUE_LIST) == 3
    finally:
        api.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(api.wait, 30)
    assert code == 0, log.read_text()
