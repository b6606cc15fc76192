"""Sessions on a real redis-server: a session's calls listed in the order they were made, a
retry keeping its place, a refused submit leaving no entry, acknowledging and cancelling a
session covering every call of it, and the index expiring with the retention."""

from __future__ import annotations

import pytest
import redis.asyncio as aredis

from statemachine import Status
from store import defaults, sessions
from store.client import BatchConflict, RolloutClient
from store.errors import InvalidSessionId
from store.keys import Keys
from store.redis_server import RedisServer
from tests import factories as f
from tests.store.trainer import dump, finish

pytestmark = pytest.mark.redis_server
# Braces and colons would break a key's hash tag were the id put in the key as it is.
S = "trajectory:{7}/turns"


async def test_a_sessions_calls_in_order_with_their_states(client: RolloutClient) -> None:
    first = await client.submit([f.request()], n=2, batch_id="c1", session=S)
    await client.submit([f.request(prompt=(1, 2, 3 + 1))], batch_id="c2", session=S)
    await client.submit([f.request(prompt=(1, 2, 3 + 2))], batch_id="other", session="another")
    await client.submit([f.request(prompt=(1, 2, 3 + 3))], batch_id="c3", session=S)
    await client.submit([f.request()], n=2, batch_id="c1", session=S)  # a retry: same place
    await finish(client.store, next(iter(first)))
    calls = await client.session(S)
    assert [c.batch_id for c in calls] == ["c1", "c2", "c3"]
    assert [c.ids for c in calls] == [list(first), ["c2.0.0"], ["c3.0.0"]]
    assert [c.statuses for c in calls] == [("done", "pending"), ("pending",), ("pending",)]
    assert calls[0].at < calls[1].at < calls[2].at
    assert [c.batch_id for c in await client.session("another")] == ["other"]
    assert await client.session("never") == []
    # One key, its hash tag a digest: the id's braces and colons are not in it.
    [key] = [k for k in await client.redis.keys("dr:session:*")
             if k == Keys().session(S).encode()]  # fmt: skip
    assert key.count(b"{") == 1 and b"trajectory" not in key


async def test_a_refused_submit_lists_nothing(
    client: RolloutClient, real_redis: aredis.Redis
) -> None:
    await client.submit([f.request()], batch_id="taken", session="mine")
    before = await dump(real_redis)
    # Another session's call under a batch id recorded with another submission: a 409, and
    # "taken" (mine's call) does not become theirs.
    with pytest.raises(BatchConflict):
        await client.submit([f.request(prompt=(1, 2, 3 + 9))], batch_id="taken", session="theirs")
    for bad in ("", "a\nb", "x" * 257):
        with pytest.raises(InvalidSessionId):
            await client.submit([f.request()], batch_id="fresh", session=bad)
    assert await dump(real_redis) == before
    assert await client.session("theirs") == []


async def test_an_entry_whose_batch_never_recorded_is_skipped(client: RolloutClient) -> None:
    """A crash between the index's entry and the batch's record (the entry goes first)."""
    await sessions.note(client.redis, client.keys, S, "lost", 1.0, 60)
    await client.submit([f.request()], batch_id="kept", session=S)
    assert [c.batch_id for c in await client.session(S)] == ["kept"]
    assert [r for r in await client.cancel(session=S)] == ["kept.0.0"]


async def test_ack_a_session(client: RolloutClient) -> None:
    a = await client.submit([f.request()], n=2, batch_id="a", session=S)
    b = await client.submit([f.request(prompt=(1, 2, 3 + 1))], batch_id="b", session=S)
    for rid in list(a):
        await finish(client.store, rid)
    report = await client.ack(session=S)
    assert sorted(report.acked) == sorted(a) and report.live == list(b)
    assert [c.batch_id for c in await client.session(S)] == ["b"]  # a's record is gone
    assert await client.batches() == ["b"]
    await finish(client.store, next(iter(b)))
    report = await client.ack(session=S)
    assert report.acked == list(b) and not report.live
    assert await client.session(S) == [] and await client.batches() == []
    assert not await client.redis.exists(client.keys.session(S))


async def test_cancel_a_session_skips_ended_calls(client: RolloutClient) -> None:
    a = await client.submit([f.request()], n=2, batch_id="a", session=S)
    b = await client.submit([f.request(prompt=(1, 2, 3 + 1))], batch_id="b", session=S)
    await finish(client.store, next(iter(a)))
    cancelled = await client.cancel(session=S, reason="trajectory abandoned")
    assert cancelled == [list(a)[1], *b]
    assert [c.statuses for c in await client.session(S)] == [("done", "cancelled"),
                                                            ("cancelled",)]  # fmt: skip
    assert await client.statuses(list(b)) == [Status.CANCELLED.value]
    with pytest.raises(ValueError, match="session alone"):
        await client.cancel(list(b), session=S)
    with pytest.raises(ValueError, match="session alone"):
        await client.ack(batch_id="a", session=S)


async def test_a_rollout_acknowledged_alone_is_listed_gone(client: RolloutClient) -> None:
    a = await client.submit([f.request()], n=2, batch_id="a", session=S)
    await finish(client.store, next(iter(a)))
    await client.ack([next(iter(a))])
    [call] = await client.session(S)
    assert call.statuses == (sessions.GONE, "pending")


async def test_the_index_expires_with_the_retention(redis_server: RedisServer,
                                                    real_redis: aredis.Redis) -> None:  # fmt: skip
    kept = RolloutClient(redis_server.url, retention_s=0)
    short = RolloutClient(redis_server.url, retention_s=100)
    try:
        await kept.submit([f.request()], batch_id="k", session="forever")
        await short.submit([f.request()], batch_id="s", session="for-a-while")
        assert await real_redis.ttl(kept.keys.session("forever")) == -1
        ttl = await real_redis.ttl(short.keys.session("for-a-while"))
        assert 100 < ttl <= 100 + defaults.SESSION_GRACE_S
    finally:
        await kept.aclose()
        await short.aclose()
