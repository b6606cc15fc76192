"""The event-store contract, run on fakeredis and on a real redis-server (see conftest)."""

from __future__ import annotations

import asyncio

import pytest

from statemachine import (
    AbortReason,
    IllegalTransition,
    OffsetMismatch,
    RolloutState,
    Status,
    TokensAppended,
    codec,
)
from store import (
    EventStore,
    InvalidRolloutId,
    RolloutExists,
    RolloutNotFound,
    SequenceConflict,
    StaleAttempt,
)
from tests import factories as f


async def assert_consistent(store: EventStore, rid: str, expected: RolloutState) -> None:
    """Invariant 1: the snapshot equals the fold of the log, and both equal what we expect."""
    loaded, replayed = await store.load(rid), await store.replay(rid)
    assert loaded == replayed == expected


async def generating(store: EventStore, rid: str = "r1", max_tokens: int = 64) -> RolloutState:
    s = await store.append(None, f.submitted(rid, max_tokens=max_tokens))
    return await store.append(s, f.started(s, worker="w1"))


async def test_append_load_replay_agree_after_every_operation(store: EventStore) -> None:
    s = await store.append(None, f.submitted("r1", max_tokens=12))
    await assert_consistent(store, "r1", s)
    steps = [
        lambda s: f.started(s),
        lambda s: f.tokens(s, n=3, routes=True),
        lambda s: f.tokens(s, n=2, routes=True),
        lambda s: f.aborted(s, AbortReason.WEIGHT_UPDATE),
        lambda s: f.resumed(s, version=1),
        lambda s: f.tokens(s, n=4, version=1, routes=True),
        lambda s: f.finished(s),
    ]
    for step in steps:
        s = await store.append(s, step(s))
        await assert_consistent(store, "r1", s)
    assert s.status is Status.DONE and s.num_tokens == 9
    assert (await store.load("r1")).weight_versions.tolist() == [0] * 5 + [1] * 4


async def test_racing_appenders_exactly_one_wins_each_seq(store: EventStore) -> None:
    s = await generating(store)
    for _round in range(5):
        # Eight writers, each with its own chunk for the same next seq.
        candidates = [f.tokens(s, [1000 * w + s.num_tokens]) for w in range(8)]
        results = await asyncio.gather(
            *(store.append(s, e) for e in candidates), return_exceptions=True
        )
        winners = [r for r in results if isinstance(r, RolloutState)]
        losers = [r for r in results if not isinstance(r, RolloutState)]
        assert len(winners) == 1
        assert all(isinstance(r, SequenceConflict) for r in losers) and len(losers) == 7
        s = winners[0]
        await assert_consistent(store, "r1", s)
    assert s.num_tokens == 5 and len(await store.events("r1")) == 2 + 5


async def test_stale_attempt_is_refused_and_writes_nothing(store: EventStore) -> None:
    s1 = await generating(store)
    s1 = await store.append(s1, f.tokens(s1, n=2))
    # The reaper declares worker w1 lost; w2 resumes as attempt 2.
    s_ab = await store.append(s1, f.aborted(s1, AbortReason.WORKER_LOST))
    stale_tokens = f.tokens(s1, n=1)  # w1 still thinks attempt 1 is live
    with pytest.raises(StaleAttempt) as err:
        await store.append(s1, stale_tokens)
    assert err.value.live == 0
    s2 = await store.append(s_ab, f.resumed(s_ab, worker="w2"))
    for late in (f.tokens(s1, n=1), f.finished(s1), f.aborted(s1, AbortReason.SHUTDOWN)):
        with pytest.raises(StaleAttempt) as err:
            await store.append(s1, late)
        assert (err.value.attempt, err.value.live) == (1, 2)
    await assert_consistent(store, "r1", s2)
    s2 = await store.append(s2, f.tokens(s2, n=2))
    await assert_consistent(store, "r1", s2)


async def test_retried_append_is_not_applied_twice(store: EventStore) -> None:
    s = await generating(store)
    chunk = f.tokens(s, n=3)
    after = await store.append(s, chunk)
    # The reply was "lost": the writer retries the same record, possibly several times.
    for _ in range(3):
        assert await store.append(s, chunk) == after
    # Even after the rollout moved on (the reaper aborted it), the retry is still a success.
    ab = await store.append(after, f.aborted(after))
    assert await store.append(s, chunk) == after
    await assert_consistent(store, "r1", ab)
    assert len(await store.events("r1")) == 4
    # Same seq, different bytes is not a retry: it is a conflict (or stale, here).
    with pytest.raises((SequenceConflict, StaleAttempt)):
        await store.append(s, f.tokens(s, n=2))


async def test_submit_is_idempotent_and_ids_are_unique(store: EventStore) -> None:
    sub = f.submitted("r1")
    s = await store.append(None, sub)
    assert await store.append(None, sub) == s
    with pytest.raises(RolloutExists):
        await store.append(None, f.submitted("r1", max_tokens=3))
    await assert_consistent(store, "r1", s)


async def test_illegal_events_raise_before_anything_is_sent(store: EventStore) -> None:
    s = await store.append(None, f.submitted("r1"))
    with pytest.raises(IllegalTransition):
        await store.append(s, f.tokens(s, n=1))  # tokens while pending: not in the table
    await assert_consistent(store, "r1", s)
    with pytest.raises(RolloutNotFound):
        await store.load("missing")
    with pytest.raises(RolloutNotFound):
        await store.replay("missing")
    assert not await store.exists("missing") and await store.exists("r1")


@pytest.mark.parametrize("bad", ["", "a{b}", "a:b", "has space", "x" * 201])
async def test_bad_rollout_ids_are_refused(store: EventStore, bad: str) -> None:
    with pytest.raises(InvalidRolloutId):
        await store.load(bad)


async def test_append_many_succeeds_and_refuses_per_item(store: EventStore) -> None:
    a = await generating(store, "a")
    b = await generating(store, "b")
    b_ab = await store.append(b, f.aborted(b))  # b's attempt is no longer live
    results = await store.append_many([(a, [f.tokens(a, n=2)]), (b, [f.tokens(b, n=2)])])
    assert isinstance(results[0], RolloutState) and results[0].num_tokens == 2
    assert isinstance(results[1], StaleAttempt)
    await assert_consistent(store, "a", results[0])
    await assert_consistent(store, "b", b_ab)
    assert await store.append_many([]) == []


async def test_keys_share_one_hash_tag(store: EventStore) -> None:
    await generating(store, "tagged")
    # SCAN, not KEYS: on a cluster redis-py walks every master with it.
    keys = sorted([k.decode() async for k in store.redis.scan_iter(match="*tagged*")])
    assert keys == ["dr:{tagged}:log", "dr:{tagged}:snap"]


async def test_corrupted_stored_record_is_reported_not_misread(store: EventStore) -> None:
    s = await generating(store)
    s = await store.append(s, f.tokens(s, n=2))
    log = store.keys.log("r1")
    entries = await store.redis.xrange(log)
    damaged = bytearray(entries[2][1][b"e"])
    damaged[20] ^= 0x40  # one flipped bit inside event #3, as a failing disk would leave it
    await store.redis.delete(log)
    for n, (entry_id, fields) in enumerate(entries):
        await store.redis.xadd(log, {"e": bytes(damaged) if n == 2 else fields[b"e"]}, id=entry_id)
    from statemachine import CorruptRecord

    with pytest.raises(CorruptRecord, match=r"rollout 'r1' event #3"):
        await store.replay("r1")
    with pytest.raises(CorruptRecord, match=r"rollout 'r1' event #3"):
        await store.load("r1")


async def test_client_must_not_decode_responses(redis_client) -> None:  # type: ignore[no-untyped-def]
    import redis.asyncio as aredis

    pool = redis_client.connection_pool
    decoding = aredis.Redis(
        connection_pool=pool.__class__(
            connection_class=pool.connection_class,
            **{**pool.connection_kwargs, "decode_responses": True},
        )
    )
    with pytest.raises(ValueError, match="decode_responses"):
        EventStore(decoding)
    await decoding.aclose()


def test_token_event_survives_the_store_encoding_exactly() -> None:
    from statemachine import apply

    s0 = apply(None, f.submitted())
    s1 = apply(s0, f.started(s0))
    e = f.tokens(s1, n=5, routes=True)
    assert isinstance(codec.decode(codec.encode(e)), TokensAppended)


async def test_append_many_chains_apply_in_order_and_fail_alone(store: EventStore) -> None:
    from statemachine import apply

    a = await generating(store, "a", max_tokens=6)
    b = await generating(store, "b")
    c = await generating(store, "c")
    a_tokens = f.tokens(a, n=6)
    a_done = f.finished(apply(a, a_tokens))
    results = await store.append_many(
        [
            (a, [a_tokens, a_done]),  # tokens then finished, one rollout, one round trip
            (b, [f.tokens(b, n=2), f.tokens(b, n=1, offset=0, seq=b.seq + 2)]),  # 2nd illegal
            (c, []),
        ]
    )
    assert isinstance(results[0], RolloutState) and results[0].status is Status.DONE
    assert isinstance(results[1], OffsetMismatch)  # refused in Python, never sent
    assert results[2] == c
    await assert_consistent(store, "a", results[0])
    await assert_consistent(store, "b", b)  # nothing of b's chain was written
