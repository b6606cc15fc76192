"""A trainer acknowledges a rollout the moment it ends, while the worker's rq bookkeeping of
its job is still in motion: nothing of the acknowledged rollout may stay in Redis.

Seen in CI (tests/workers/test_trainer_loop.py, 1 of 1,000 rollouts): a bare ``rq:job:<id>``
hash holding only ``last_heartbeat`` outlived the ack. The heartbeat had been queued on the
bookkeeping thread behind the job's success and still listed the job as running: the ack
deleted the job between the two, and the heartbeat's HSET wrote it back, with no TTL.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from redis import Redis

from store import EventStore
from store.client import RolloutClient
from store.redis_server import RedisServer
from tests import factories as f
from workers.rq_bridge import RqBridge

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
