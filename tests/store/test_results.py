"""Results in completion order, groups, take=k, cancel, acknowledge, retention and stats.

A real redis-server; the worker is played by appends through the same store and commands a
worker uses (tests/store/trainer.py), so the order and the timing of ends is the test's."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aredis

from statemachine import FailureClass, Status, commands
from store import RolloutNotFound
from store.client import RolloutClient, RolloutEnded, UnknownPosition, WaitTimeout
from store.redis_server import RedisServer
from store.results import RolloutResult
from tests import factories as f
from tests.damage import damage_event
from tests.store.trainer import ack_before_the_load, checkpoint, dump, finish, start


async def collect(agen: AsyncIterator[RolloutResult], n: int) -> list[RolloutResult]:
    out = []
    async for r in agen:
        out.append(r)
        if len(out) == n:
            break
    return out


async def test_results_come_in_the_order_rollouts_ended(client: RolloutClient) -> None:
    batch = await client.submit([f.request()] * 3, n=2, batch_id="b")
    order = [batch[4], batch[0], batch[5], batch[1], batch[3], batch[2]]
    for rid in order[:2]:
        await finish(client.store, rid)
    got: list[RolloutResult] = []

    async def consume() -> None:
        async for r in client.results("b"):
            got.append(r)

    reader = asyncio.create_task(consume())
    for rid in order[2:]:
        await asyncio.sleep(0.05)
        await finish(client.store, rid, n=3)
    await asyncio.wait_for(reader, 10)
    assert [r.rollout_id for r in got] == order
    assert [r.status for r in got] == [Status.DONE] * 6
    positions = [r.position for r in got]
    assert positions == sorted(positions, key=lambda p: tuple(map(int, p.split("-"))))
    r = got[0]
    assert (r.batch_id, r.group_index, r.sample_index, r.group_size) == ("b", 2, 0, 2)
    assert r.response_token_ids.tolist() == [10, 11, 12, 13]


async def test_a_reader_that_restarts_resumes_after_its_position(client: RolloutClient) -> None:
    batch = await client.submit([f.request()] * 4, batch_id="b")
    for rid in batch:
        await finish(client.store, rid)
    first = await collect(client.results("b"), 2)
    rest = [r.rollout_id async for r in client.results("b", after=first[-1].position)]
    assert [r.rollout_id for r in first] + rest == list(batch)


async def test_wait_is_a_layer_over_the_streams(client: RolloutClient) -> None:
    old = await client.submit([f.request()], ids=["old"])  # ends before the wait starts
    await finish(client.store, "old")
    batch = await client.submit([f.request()] * 2, batch_id="w")
    with pytest.raises(WaitTimeout, match="2 of 2"):
        await client.wait(list(batch), timeout=0.2)
    waiter = asyncio.create_task(client.wait([batch[1], *old, batch[0]]))
    await asyncio.sleep(0.1)
    for rid in batch:
        await finish(client.store, rid)
    results = await asyncio.wait_for(waiter, 10)
    assert [r.rollout_id for r in results] == [batch[1], "old", batch[0]]
    with pytest.raises(RolloutNotFound):
        await client.wait(["nope"])


async def test_one_unreadable_rollout_is_its_own_error(
    client: RolloutClient, real_redis: aredis.Redis
) -> None:
    batch = await client.submit([f.request()] * 3, batch_id="b")
    for rid in batch:
        await finish(client.store, rid)
    await damage_event(real_redis, client.store, batch[1], 3)  # its tokens record
    results = [r async for r in client.results("b")]
    assert [r.status for r in results] == [Status.DONE, Status.FAILED, Status.DONE]
    assert results[1].failure is FailureClass.UNREADABLE and "checksum" in (results[1].error or "")
    waited = await client.wait(list(batch))
    assert [r.failure for r in waited] == [None, FailureClass.UNREADABLE, None]


async def test_groups_arrive_whole_and_take_k_cancels_the_rest(client: RolloutClient) -> None:
    batch = await client.submit([f.request()] * 4, n=2, batch_id="b")
    groups = batch.groups()
    live = await start(client.store, groups[3][0])
    live = await checkpoint(client.store, live, 3)
    await finish(client.store, groups[1][1])  # half of group 1: not yet a group
    for rid in (*groups[2], groups[1][0]):
        await finish(client.store, rid)
    got = [g async for g in client.groups("b", take=2)]
    assert [(g.group_index, g.complete) for g in got] == [(2, True), (1, True)]
    assert [r.sample_index for r in got[1].results] == [0, 1]
    statuses = dict(zip(batch, await client.statuses(list(batch)), strict=True))
    assert [statuses[rid] for rid in (*groups[0], *groups[3])] == ["cancelled"] * 4
    kept = await client.result(groups[3][0])  # was live: its saved tokens stay
    assert kept.status is Status.CANCELLED and kept.response_token_ids.tolist() == [10, 11, 12]


async def test_cancel_pending_live_group_and_batch(client: RolloutClient) -> None:
    batch = await client.submit([f.request()] * 3, n=2, batch_id="b")
    live = await checkpoint(client.store, await start(client.store, batch[0]), 2)
    assert await client.cancel([batch[0], batch[1]]) == [batch[0], batch[1]]
    # The live attempt is fenced: its worker's next checkpoint is refused.
    from store import StaleAttempt

    with pytest.raises(StaleAttempt):
        await checkpoint(client.store, live, 2)
    assert (await client.result(batch[0])).response_token_ids.tolist() == [10, 11]
    assert sorted(await client.cancel(batch_id="b", group=1)) == sorted(batch[2:4])
    await finish(client.store, batch[4])
    assert await client.cancel(batch_id="b") == [batch[5]]  # ended ones skipped
    assert await client.statuses(list(batch)) == ["cancelled"] * 4 + ["done", "cancelled"]


async def test_cancelling_an_ended_rollout_is_refused_and_changes_nothing(
    client: RolloutClient, real_redis: aredis.Redis
) -> None:
    batch = await client.submit([f.request()] * 2, batch_id="b")
    await finish(client.store, batch[0])
    before = await dump(real_redis)
    with pytest.raises(RolloutEnded, match="done"):
        await client.cancel(list(batch))
    assert await dump(real_redis) == before


async def test_cancel_wins_a_race_with_the_workers_checkpoints(client: RolloutClient) -> None:
    batch = await client.submit([f.request(max_tokens=10_000)], batch_id="b")
    state = await start(client.store, batch[0])
    stop = asyncio.Event()

    async def worker() -> None:
        nonlocal state
        from store import StaleAttempt

        while not stop.is_set():
            try:
                state = await checkpoint(client.store, state, 1)
            except StaleAttempt:
                return
            # 1,000 checkpoints a second: far above a real worker's (one per 16 tokens or
            # 0.25 s per rollout), yet the cancel must get through.
            await asyncio.sleep(0.001)

    task = asyncio.create_task(worker())
    await asyncio.sleep(0.05)
    assert await client.cancel(list(batch)) == list(batch)
    await asyncio.wait_for(task, 5)
    assert await client.statuses(list(batch)) == ["cancelled"]


async def test_ack_deletes_ended_rollouts_and_never_a_live_one(
    client: RolloutClient, real_redis: aredis.Redis
) -> None:
    baseline = await dump(real_redis)
    batch = await client.submit([f.request()] * 3, batch_id="b")
    await finish(client.store, batch[0])
    await start(client.store, batch[1])
    report = await client.ack(list(batch))
    assert (report.acked, report.live) == ([batch[0]], [batch[1], batch[2]])
    assert not await client.store.exists(batch[0]) and await client.store.exists(batch[1])
    again = await client.ack([batch[0]])
    assert again.missing == [batch[0]]
    # The stream keeps only the live ones' future entries: results skip the acknowledged.
    await finish(client.store, batch[2])
    await client.cancel([batch[1]])
    assert [r.rollout_id async for r in client.results("b")] == [batch[2], batch[1]]
    await client.ack(batch_id="b")
    after = await dump(real_redis)
    # Only the counters and rq's queue remain; with no worker here to pop them, the queue
    # still lists the jobs, whose records ack deleted (a worker's pop skips such ids).
    left = set(after) - set(baseline)
    assert left <= {b"dr:stats", b"rq:queues", b"rq:queue:rollouts"}, left
    for job_id in await real_redis.lrange("rq:queue:rollouts", 0, -1):
        assert not await real_redis.exists(b"rq:job:" + job_id)
    assert await client.batches() == []


async def test_unacknowledged_results_expire_after_the_retention(
    redis_server: RedisServer, real_redis: aredis.Redis
) -> None:
    client = RolloutClient(redis_server.url, retention_s=1)
    try:
        batch = await client.submit([f.request()] * 2, batch_id="b")
        await finish(client.store, batch[0])
        await start(client.store, batch[1])
        ttl = await real_redis.ttl(client.keys.snapshot(batch[0]))
        assert 0 < ttl <= 1
        assert await real_redis.ttl(client.keys.snapshot(batch[1])) == -1  # live: kept
        await asyncio.sleep(1.5)
        assert not await client.store.exists(batch[0])
        assert await client.store.exists(batch[1])
    finally:
        await client.aclose()
    keep = RolloutClient(redis_server.url, retention_s=0)
    try:
        kept = await keep.submit([f.request()], batch_id="k")
        await finish(keep.store, kept[0])
        assert await real_redis.ttl(keep.keys.snapshot(kept[0])) == -1
    finally:
        await keep.aclose()


async def test_stats_count_states_and_tokens_in_one_round_trip(
    client: RolloutClient, real_redis: aredis.Redis
) -> None:
    batch = await client.submit([f.request()] * 5, batch_id="b")
    await finish(client.store, batch[0], n=4)
    live = await checkpoint(client.store, await start(client.store, batch[1]), 3)
    await client.store.append(live, commands.fail(live, "bad", FailureClass.REQUEST_ERROR))
    await start(client.store, batch[2])
    await client.cancel([batch[3]])
    await client.stats()  # the script's first use loads it
    await real_redis.config_resetstat()
    stats = await client.stats()
    calls = await real_redis.info("commandstats")
    assert calls["cmdstat_evalsha"]["calls"] == 1 and "cmdstat_hgetall" in calls
    assert {s.value: n for s, n in stats.by_state.items() if n} == {
        "pending": 1, "generating": 1, "done": 1, "failed": 1, "cancelled": 1,
    }  # fmt: skip
    assert stats.tokens == 7 and stats.in_flight == 1
    assert stats.queues == {"rollouts": 5}  # nothing took the jobs: no worker here


async def test_results_take_k_and_the_sync_client(
    redis_server: RedisServer, real_redis: aredis.Redis
) -> None:
    import threading

    from store.sync_client import SyncRolloutClient

    sync = SyncRolloutClient(redis_server.url)
    try:
        batch = sync.submit([f.request()] * 3, n=2, batch_id="s")
        store = sync._client.store

        def worker() -> None:
            # Group 1 ends first; the others are cancelled by take=1.
            import asyncio as aio

            async def run() -> None:
                for rid in batch.groups()[1]:
                    await finish(store, rid)

            aio.run_coroutine_threadsafe(run(), sync._loop).result()

        threading.Thread(target=worker).start()
        got = list(sync.results("s", take=1, timeout=10))
        assert [r.rollout_id for r in got] == batch.groups()[1]
        assert (
            sorted(sync._call(sync._client.statuses(list(batch))))
            == ["cancelled"] * 4 + ["done"] * 2
        )
        assert sync.stats().by_state[Status.CANCELLED] == 4
        assert sync.ack(batch_id="s").acked and sync.batches() == []
    finally:
        sync.close()


async def test_rollouts_acknowledged_while_their_block_is_read_are_skipped(
    client: RolloutClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 28: an ack landing between a block's XREAD and its load raised RolloutNotFound
    out of ``results``; the README promises acknowledged rollouts are skipped."""
    batch = await client.submit([f.request()] * 4, batch_id="b")
    for rid in batch:
        await finish(client.store, rid)
    asked = ack_before_the_load(monkeypatch, client, ids=[batch[1], batch[2]])
    got = [r.rollout_id async for r in client.results("b", timeout=10)]
    assert asked == [list(batch)]  # one block: the ack landed inside it
    assert got == [batch[0], batch[3]]


async def test_a_batch_acknowledged_while_its_results_are_read_ends_the_read(
    client: RolloutClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    batch = await client.submit([f.request()] * 2, n=2, batch_id="b")
    for rid in batch:
        await finish(client.store, rid)
    ack_before_the_load(monkeypatch, client, batch_id="b")
    assert [r async for r in client.results("b", timeout=10)] == []
    assert await client.batches() == []


async def test_take_k_while_the_trainer_acknowledges_what_it_took(
    client: RolloutClient,
) -> None:
    """The client's own loop (``groups`` then ``ack`` of each group) under ``take=k``: the
    cancel of the rest met the groups acknowledged meanwhile and raised RolloutNotFound."""
    batch = await client.submit([f.request()] * 3, n=2, batch_id="b")
    groups = batch.groups()
    for rid in (*groups[2], *groups[0]):
        await finish(client.store, rid)
    took = []
    async for group in client.groups("b", take=2, timeout=10):
        took.append(group.group_index)
        report = await client.ack(group.rollout_ids)
        assert report.acked == group.rollout_ids
    assert took == [2, 0]
    assert await client.statuses(groups[1]) == ["cancelled", "cancelled"]
    assert not await client.store.exists(groups[0][0])


async def test_a_position_not_of_the_batch_is_refused_by_name(
    client: RolloutClient, real_redis: aredis.Redis
) -> None:
    """Issue 28: ``after`` naming no entry of the batch's stream returned nothing and ended
    normally (every result at or before it counted as delivered, none after it came)."""
    batch = await client.submit([f.request()] * 3, batch_id="b")
    other = await client.submit([f.request()], batch_id="other")
    with pytest.raises(UnknownPosition, match="after: '5-0' is not a position of batch 'b'"):
        await collect(client.results("b", after="5-0", timeout=2), 1)  # no stream yet
    for rid in (*batch, *other):
        await finish(client.store, rid)
    mine = [r.position async for r in client.results("b")]
    [theirs] = [r.position async for r in client.results("other")]  # after all of b's
    ms, seq = map(int, mine[0].split("-"))
    before = await dump(real_redis)
    for bad in (theirs, "1-0", f"{ms}-{seq + 7}", f"{ms + 10**9}-0", "x", "1", "-", "$"):
        with pytest.raises(UnknownPosition, match=r"after: .* is not a position of batch 'b'"):
            await collect(client.results("b", after=bad, timeout=5), 1)
    assert await dump(real_redis) == before
    # Still accepted: a result's position, and the start.
    assert [r.rollout_id async for r in client.results("b", after=mine[0])] == list(batch[1:])
    assert len([r async for r in client.results("b", after="0-0")]) == 3


async def test_a_position_acknowledged_since_still_resumes(client: RolloutClient) -> None:
    """A trainer that acknowledged what it handled, then restarted, resumes after its last
    position, whose entry the ack deleted: that is a position of the batch, not refused."""
    batch = await client.submit([f.request()] * 4, batch_id="b")
    for rid in batch:
        await finish(client.store, rid)
    first = await collect(client.results("b"), 2)
    await client.ack([r.rollout_id for r in first])
    rest = [r.rollout_id async for r in client.results("b", after=first[-1].position)]
    assert rest == list(batch[2:])
    assert [r.rollout_id async for r in client.results("b", after=first[0].position)] == rest


async def test_a_cancel_retried_as_it_was_is_not_refused(
    client: RolloutClient, real_redis: aredis.Redis
) -> None:
    """A trainer whose cancel lost its reply (or was not confirmed by enough replicas:
    ``--min-replicas-acked``) sends it again: rollouts it cancelled are not "ended" to it,
    and the answer is the first one's. A rollout that ended otherwise still refuses it."""
    batch = await client.submit([f.request()] * 3, batch_id="b")
    first = await client.cancel(list(batch[:2]))
    assert first == list(batch[:2])
    before = await dump(real_redis)
    assert await client.cancel(list(batch[:2])) == first
    assert await dump(real_redis) == before  # nothing cancelled twice
    await finish(client.store, batch[2])
    with pytest.raises(RolloutEnded, match="done"):
        await client.cancel(list(batch))
