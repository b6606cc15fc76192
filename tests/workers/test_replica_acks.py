"""``rollouts worker --min-replicas-acked N``: a checkpoint counts as saved only once N replicas
of its Redis confirm it (WAIT on the connection that wrote it). Short of them, the worker keeps
its tokens and retries, as for a write Redis refuses; once a replica is there, every rollout
ends as it would have, token for token, and the replica holds all of it (real redis-servers,
a real worker on the synthetic engine)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import redis.asyncio as aredis
from redis import Redis

from statemachine import Status
from store import EventStore
from store.errors import Refusal
from store.queue import enqueue_rollouts, rollout_queue
from store.redis_server import RedisServer
from tests import factories as f
from workers.cli import build_parser
from workers.engines.synthetic import SyntheticEngine
from workers.worker import Worker, WorkerConfig

pytestmark = pytest.mark.redis_server
PROMPT = (1, 2, 3)  # tests.factories' default prompt


async def _until_synced(replica: aredis.Redis, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while (await replica.info("replication")).get("master_link_status") != "up":
        assert time.monotonic() < deadline, "the replica never synced"
        await asyncio.sleep(0.05)


async def test_checkpoints_wait_for_a_replica_and_lose_nothing(tmp_path: Path) -> None:
    with RedisServer(tmp_path / "master") as master, RedisServer(tmp_path / "replica") as spare:
        client = aredis.Redis.from_url(master.url)
        store = EventStore(client)
        rids = [f"r{i}" for i in range(3)]
        for rid in rids:
            await store.append(None, f.submitted(rid, max_tokens=40))
        enqueue_rollouts(rollout_queue(Redis.from_url(master.url)), rids)
        cfg = WorkerConfig(redis_url=master.url, max_concurrency=3, burst=True,
                           min_replicas_acked=1)  # fmt: skip
        worker = Worker(cfg, SyntheticEngine(tokens_per_chunk=4))
        running = asyncio.ensure_future(worker.run())
        # No replica: nothing the worker writes is confirmed, so nothing is counted saved.
        deadline = time.monotonic() + 20
        while worker.condition.refused_writes < 3:
            assert time.monotonic() < deadline and not running.done()
            await asyncio.sleep(0.05)
        assert worker.condition.refusal is not None
        assert worker.condition.refusal.refusal is Refusal.NOREPLICAS
        await asyncio.sleep(1.0)
        assert not running.done()
        # A replica joins: the retried writes are confirmed (each a repeat, recognised).
        replica = aredis.Redis.from_url(spare.url)
        await replica.execute_command("REPLICAOF", "127.0.0.1", str(master.port))
        await _until_synced(replica)
        await asyncio.wait_for(running, 60)
        for rid in rids:
            state = await store.load(rid)
            assert state.status is Status.DONE
            assert state.token_ids.tolist() == [(sum(PROMPT) + i) % 32_000 for i in range(40)]
            # What the master acknowledged, its replica holds.
            assert await EventStore(replica).load(rid) == state
        await client.aclose()
        await replica.aclose()


@pytest.mark.parametrize(("given", "parsed"), [([], 0), (["--min-replicas-acked", "2"], 2)])
def test_the_flag_reaches_the_worker(given: list[str], parsed: int) -> None:
    args = build_parser().parse_args(["worker", *given])
    assert args.min_replicas_acked == parsed


@pytest.mark.parametrize("bad", ["-1", "one"])
def test_a_bad_count_is_refused_by_name(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["worker", "--min-replicas-acked", bad])
    assert exit_.value.code == 2 and "count of replicas" in capsys.readouterr().err
