"""The record of an append travels beside its fencing script, never through it
(``store/lua/append.lua``): what that split must never let through, on fakeredis and on a real
redis-server. The record's XADD goes first and the script undoes it when it refuses the event,
so after every transaction the log's last id must be its snapshot's seq: a record after it
would block the next writer, and be a refused writer's bytes."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest

from statemachine import RolloutState, Submitted, apply
from store import EventStore, SequenceConflict, StaleAttempt, scripts
from tests import factories as f


async def generating(store: EventStore, rid: str = "r1") -> RolloutState:
    s = await store.append(None, f.submitted(rid, max_tokens=64))
    return await store.append(s, f.started(s))


async def log_of(store: EventStore, rid: str) -> list[Any]:
    return list(await store.redis.xrange(store.keys.log(rid)))


async def last_id_is_the_snapshots_seq(store: EventStore, rid: str) -> bool:
    log, snap = store.keys.rollout(rid)
    info = await store.redis.xinfo_stream(log)
    return info["last-generated-id"] == b"0-" + await store.redis.hget(snap, "seq")


async def test_a_refused_record_never_lands_and_never_blocks_the_next_writer(
    store: EventStore,
) -> None:
    s1 = await generating(store)
    s1 = await store.append(s1, f.tokens(s1, n=2))
    ab = await store.append(s1, f.aborted(s1))
    before = await log_of(store, "r1")
    # The stale writer's chunk takes the next seq (the one Resumed will take): its view of the
    # rollout is as new as can be but for the abort. Refused.
    view = replace(s1, seq=ab.seq)
    with pytest.raises(StaleAttempt):
        await store.append(view, f.tokens(view, n=3))
    # A writer with a gap (seq two ahead) is refused too.
    ahead = replace(ab, seq=ab.seq + 1)
    with pytest.raises(SequenceConflict):
        await store.append(ahead, f.resumed(ahead))
    assert await log_of(store, "r1") == before
    assert await last_id_is_the_snapshots_seq(store, "r1")
    # The stream's last id is still the snapshot's seq: the legitimate writer of that seq
    # (and every one after it) is not refused by the XADD.
    s2 = await store.append(ab, f.resumed(ab))
    s2 = await store.append(s2, f.tokens(s2, n=1))
    assert await store.load("r1") == await store.replay("r1") == s2
    assert [e.seq for e in await store.events("r1")] == list(range(1, s2.seq + 1))


async def test_a_stale_writers_bytes_are_never_read_under_races(store: EventStore) -> None:
    """Writers of an attempt that the reaper ended race the new attempt's writer, many rounds:
    every chunk read back is one the live attempt wrote."""
    s = await generating(store)
    s = await store.append(s, f.tokens(s, n=1))
    ab = await store.append(s, f.aborted(s))
    live = await store.append(ab, f.resumed(ab))
    stale_ids = set()
    for r in range(10):
        # Each stale writer's view is current but for its attempt having ended.
        view = replace(s, seq=live.seq)
        stale = [f.tokens(view, [90_000 + 10 * r + k]) for k in range(4)]
        stale_ids |= {int(e.token_ids[0]) for e in stale}
        good = f.tokens(live, n=1)
        results = await asyncio.gather(
            *(store.append(view, e) for e in stale),
            store.append(live, good),
            return_exceptions=True,
        )
        assert all(isinstance(x, StaleAttempt) for x in results[:-1])
        assert isinstance(results[-1], RolloutState)
        live = results[-1]
    loaded = await store.load("r1")
    assert loaded == await store.replay("r1") == live
    assert not stale_ids & set(loaded.token_ids.tolist())
    assert await last_id_is_the_snapshots_seq(store, "r1")


async def test_a_refused_chain_leaves_the_log_as_it_was_for_the_next_round(
    store: EventStore,
) -> None:
    """Two events of one rollout in one transaction (two script calls): the first refused, so
    the second is a gap; neither record stays, and the rollout's own next writer succeeds."""
    s = await generating(store)
    s = await store.append(s, f.tokens(s, n=1))
    ab = await store.append(s, f.aborted(s))
    view = replace(s, seq=ab.seq)  # the ended attempt, as current as can be but for the abort
    first = f.tokens(view, n=2)
    (result,) = await store.append_many([(view, [first, f.tokens(apply(view, first), n=2)])])
    assert isinstance(result, StaleAttempt)
    assert [e.seq for e in await store.events("r1")] == list(range(1, ab.seq + 1))
    assert await last_id_is_the_snapshots_seq(store, "r1")
    s2 = await store.append(ab, f.resumed(ab))
    assert await store.load("r1") == await store.replay("r1") == s2


async def test_the_append_script_never_meets_noscript(
    store: EventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its records go in ahead of it, so it must run whenever they do: it is sent by its text.
    By sha, after a restart emptied the script cache, the XADDs would land unchecked, and stay
    if the client died before repeating the transaction by text (as it does here)."""
    s = await generating(store)
    s = await store.append(s, f.tokens(s, n=1))
    ab = await store.append(s, f.aborted(s))
    before = await log_of(store, "r1")
    await store.redis.script_flush()
    first_try = scripts._transaction

    async def dies_before_repeating(
        client: Any, steps: Any, *, by_text: bool, **kw: Any
    ) -> list[Any]:
        if by_text:
            raise ConnectionError("the client died before repeating the transaction by text")
        return await first_try(client, steps, by_text=by_text, **kw)

    monkeypatch.setattr(scripts, "_transaction", dies_before_repeating)
    view = replace(s, seq=ab.seq)
    with pytest.raises(StaleAttempt):
        await store.append(view, f.tokens(view, n=3))
    assert await log_of(store, "r1") == before
    assert await last_id_is_the_snapshots_seq(store, "r1")


async def test_appends_survive_an_emptied_script_cache(store: EventStore) -> None:
    s = await generating(store)
    await store.redis.script_flush()
    s = await store.append(s, f.tokens(s, n=2))
    await store.redis.script_flush()
    a = await store.append_many([(s, [f.tokens(s, n=1)])])
    assert isinstance(a[0], RolloutState)
    assert await store.load("r1") == await store.replay("r1") == a[0]
    assert len(await store.events("r1")) == 4


async def test_a_retried_chain_is_recognised_whole(store: EventStore) -> None:
    """A checkpoint whose reply was lost is sent again as it was: every event in it, the
    terminal one included, is a retry, and the completion is recorded once."""
    s = await generating(store)
    chunk = f.tokens(s, n=3)
    done = f.finished(apply(s, chunk))
    first = await store.append_many([(s, [chunk, done])])
    again = await store.append_many([(s, [chunk, done])])
    assert first == again and isinstance(first[0], RolloutState)
    assert len(await store.events("r1")) == 4
    assert await store.redis.xlen(store.keys.completions("")) == 1


async def test_a_retry_after_the_rollout_was_deleted_is_refused_not_a_success(
    store: EventStore,
) -> None:
    s = await generating(store)
    chunk = f.tokens(s, n=2)
    await store.append(s, chunk)
    await store.redis.delete(*store.keys.rollout("r1"))
    with pytest.raises((SequenceConflict, StaleAttempt)):
        await store.append(s, chunk)
    assert await store.redis.keys("*r1*") == []


async def test_the_log_keeps_its_retention_through_the_terminal_append(store: EventStore) -> None:
    sub = f.submitted("r1", max_tokens=8)
    sub = Submitted(
        rollout_id="r1",
        seq=1,
        request=sub.request,
        membership=replace(sub.membership, batch_id="b1"),
    )
    await store.redis.hset(store.keys.batch("b1"), "ttl", 100)
    s = await store.append(None, sub)
    s = await store.append(s, f.started(s))
    s = await store.append(s, f.tokens(s, n=2))
    s = await store.append(s, f.finished(s))
    for key in (*store.keys.rollout("r1"), store.keys.completions("b1")):
        assert 0 < await store.redis.ttl(key) <= 100
    assert await last_id_is_the_snapshots_seq(store, "r1")
    assert await store.load("r1") == s
