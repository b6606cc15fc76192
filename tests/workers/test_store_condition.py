"""A worker's view of Redis refusing writes (``workers.store_condition``), in process.

- ``StoreCondition`` counts every refused write and logs one line when an episode starts and
  one when it ends; a late reply of a write sent before the end starts no new episode, and a
  write sent before the start does not end one;
- the group commit on a real redis-server out of memory: the append waits, is retried, and
  lands once, exactly as it would have (before: the caller got redis-py's error and the run
  failed);
- rq's record of a job's start, refused, is retried until Redis takes it (before: the job
  was forgotten, swept back to the queue later and run again, rq's registries untrue);
- a worker's presence subscription holds while Redis refuses writes (its registration is
  refused; under MISCONF so is redis-py's health-check PING on it): before, each dropped the
  subscription, which showed a live worker gone to every reaper.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest
import redis.asyncio as aredis
from redis import Redis

from statemachine import Submitted, TokensAppended
from store import EventStore
from store.errors import Refusal, StoreUnwritable
from store.keys import Keys
from store.presence import SUBSCRIPTIONS, Presence
from store.queue import enqueue_rollouts, rollout_queue
from store.redis_server import RedisServer
from tests import factories as f
from tests.unwritable import conditions, oom_hold, wait_accepting, wait_refusing
from workers.checkpoint import Checkpointer
from workers.rq_bridge import RqBridge
from workers.store_condition import StoreCondition

OOM = StoreUnwritable(Refusal.OOM, "OOM command not allowed when used memory > 'maxmemory'.")


def _episode_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        getattr(r, "event", "")
        for r in caplog.records
        if getattr(r, "event", "") in ("store_unwritable", "store_writable")
    ]


def test_one_line_per_episode_start_and_end(caplog: pytest.LogCaptureFixture) -> None:
    c = StoreCondition("w")
    caplog.set_level(logging.INFO, logger="rollouts.store")
    before = time.monotonic()
    c.refused(OOM, "checkpoint")
    for _ in range(50):
        c.refused(OOM, "heartbeat")
    assert c.holds and not c.writable.is_set() and c.episodes == 1 and c.refused_writes == 51
    c.accepted(before)  # sent before the episode began: proves nothing about its end
    assert c.holds
    c.accepted(time.monotonic())
    assert not c.holds and c.writable.is_set() and c.settling(60) and not c.settling(0)
    c.refused(OOM, "rq bookkeeping", before)  # a late reply, sent before the end
    assert not c.holds and c.episodes == 1 and c.refused_writes == 52
    assert _episode_lines(caplog) == ["store_unwritable", "store_writable"]
    [start] = [r for r in caplog.records if getattr(r, "event", "") == "store_unwritable"]
    assert start.refusal == "oom" and start.write == "checkpoint"  # type: ignore[attr-defined]
    assert start.exc_info is None
    c.refused(OOM, "checkpoint")  # a new episode
    assert c.holds and c.episodes == 2
    assert _episode_lines(caplog) == ["store_unwritable", "store_writable", "store_unwritable"]


@pytest.mark.redis_server
async def test_a_refused_checkpoint_waits_and_lands_once(
    server: RedisServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="rollouts.store")
    sync = Redis.from_url(server.url)
    client = aredis.Redis.from_url(server.url)
    store = EventStore(client)
    condition = StoreCondition("w", retry_s=(0.01, 0.05))
    checkpointer = Checkpointer(store, condition=condition)
    on, off = conditions(tmp_path)["oom"]
    try:
        s = await store.append(None, Submitted(rollout_id="r", seq=1, request=f.request(64)))
        s = await checkpointer.append(s, [f.started(s, worker="w")])
        on(sync, server)
        oom_hold(sync)
        wait_refusing(sync)
        saving = asyncio.ensure_future(checkpointer.append(s, [f.tokens(s, n=8)], gather=True))
        await asyncio.sleep(0.5)
        assert not saving.done()  # waiting, not failed
        assert condition.holds and condition.refused_writes >= 3
        assert not condition.writable.is_set()
        # (``head``: ``load`` reads in a MULTI, and Redis refuses any command queued in a
        # MULTI while out of memory, reads included.)
        assert (await store.head("r")).num_tokens == 0
        off(sync, server)
        wait_accepting(sync)
        after = await asyncio.wait_for(saving, 5)
    finally:
        off(sync, server)
    assert after.num_tokens == 8
    assert await store.load("r") == after == await store.replay("r")
    assert [len(e) for e in await store.events("r") if isinstance(e, TokensAppended)] == [8]
    assert not condition.holds and condition.writable.is_set() and condition.episodes == 1
    assert _episode_lines(caplog) == ["store_unwritable", "store_writable"]
    await checkpointer.close()
    await client.aclose()
    sync.close()


@pytest.mark.redis_server
async def test_a_refused_job_start_is_retried_not_forgotten(
    server: RedisServer, sync: Redis, bridge: RqBridge, tmp_path: Path
) -> None:
    queue = rollout_queue(sync)
    enqueue_rollouts(queue, ["r1"])
    found = bridge._take(1, 1)  # taken off the queue (rq's intermediate list), not started
    taken, pipe = bridge._prepare_start(found)
    on, off = conditions(tmp_path)["oom"]
    try:
        on(sync, server)
        oom_hold(sync)
        wait_refusing(sync)
        starting = asyncio.ensure_future(asyncio.to_thread(bridge._start_or_forget, taken, pipe))
        await asyncio.sleep(0.5)
        assert not starting.done()  # waiting for Redis, not given up
        assert queue.started_job_registry.count == 0
        off(sync, server)
        wait_accepting(sync)
        await asyncio.wait_for(starting, 10)
    finally:
        off(sync, server)
    [job] = taken
    assert job.started and not job.ended
    assert queue.started_job_registry.get_job_ids() == [job.job.id]
    assert bridge.worker.executions[job.execution.id] is job.execution


@pytest.mark.redis_server
@pytest.mark.parametrize("refusal", ["oom", "misconf"])
async def test_presence_holds_while_redis_refuses_writes(
    server: RedisServer, tmp_path: Path, refusal: str
) -> None:
    sync = Redis.from_url(server.url)
    keys = Keys()
    channel = keys.presence_channel("w")
    presence, stop = Presence(server.url, "w"), asyncio.Event()
    # redis-py PINGs a subscribed connection every health_check_interval (10 s): shortened, so
    # that the PING Redis refuses under MISCONF comes within the test.
    for client in presence.clients:
        client.connection_pool.connection_kwargs["health_check_interval"] = 0.2
    task = asyncio.create_task(presence.hold(stop))
    on, off = conditions(tmp_path)[refusal]
    subscribers = []
    try:
        await asyncio.wait_for(presence.subscribed.wait(), 10)
        on(sync, server)
        if refusal == "oom":
            oom_hold(sync)
        wait_refusing(sync)
        # Its connection dropped (as by a Redis-side client kill): redis-py resubscribes, and the
        # worker registers again at once, which Redis refuses now.
        sync.client_kill_filter(_type="pubsub")
        await asyncio.sleep(0.3)  # the resubscription
        for _ in range(40):  # 2 s, several health-check PINGs
            [(_, n)] = sync.pubsub_numsub(channel)
            subscribers.append(int(n))
            await asyncio.sleep(0.05)
        refused_at = sync.hget(keys.presence(), "w")  # its registration before the condition
        off(sync, server)
        wait_accepting(sync)
        deadline = time.monotonic() + 10
        while sync.hget(keys.presence(), "w") == refused_at:
            # The one refused at the resubscription is made as soon as Redis accepts it.
            assert time.monotonic() < deadline, "never registered again"
            await asyncio.sleep(0.05)
    finally:
        off(sync, server)
        stop.set()
        await asyncio.wait_for(task, 10)
        await presence.close()
        sync.close()
    # Never absent (every subscription held): never judged gone.
    assert set(subscribers) == {SUBSCRIPTIONS}, subscribers
