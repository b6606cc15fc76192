"""The Checkpointer on fakeredis: the flush-point policy (``flush_due``), group commit of every
queued chain in one round trip, and the gather window of a flush point."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from statemachine import RolloutState
from store import EventStore
from store.errors import AppendRefused
from tests import factories as f
from workers import checkpoint
from workers.checkpoint import Cadence, Checkpointer


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    """The checkpointer's clock, and only its (the event loop keeps the real one)."""
    c = Clock()
    monkeypatch.setattr(checkpoint, "time", SimpleNamespace(monotonic=c.monotonic))
    return c


@pytest.fixture
def counted(fake_redis) -> EventStore:  # type: ignore[no-untyped-def]
    """An event store on fakeredis that counts its append_many round trips' chains."""
    store = EventStore(fake_redis)
    original = store.append_many
    store.batches = []  # type: ignore[attr-defined]

    async def append_many(chains):  # type: ignore[no-untyped-def]
        store.batches.append(len(chains))  # type: ignore[attr-defined]
        return await original(chains)

    store.append_many = append_many  # type: ignore[method-assign]
    return store


def test_flush_due_waits_for_tokens_or_interval(clock: Clock) -> None:
    cp = Checkpointer(None, cadence=Cadence(tokens=8, interval_s=1.0))  # type: ignore[arg-type]
    point = cp.flush_point()  # the first call starts the first flush point
    assert cp.flush_due(3, point, ready=True) is None  # neither full nor a new point
    clock.now += 0.5
    assert cp.flush_due(7, point, ready=True) is None
    clock.now += 0.5  # interval_s since the point started: a new one, every rollout joins
    assert cp.flush_due(1, point, ready=True) == point + 1


def test_a_full_rollout_starts_a_flush_point_the_others_join(clock: Clock) -> None:
    cp = Checkpointer(None, cadence=Cadence(tokens=8, interval_s=10.0))  # type: ignore[arg-type]
    point = cp.flush_point()
    new = cp.flush_due(8, point, ready=True)  # full: starts a point
    assert new == point + 1 == cp.flush_points
    assert cp.flush_due(1, point, ready=True) == new  # another rollout joins with 1 token
    assert cp.flush_due(1, new, ready=True) is None  # it already joined this point
    # Full just as it sees another's point: it joins that one instead of starting its own.
    assert cp.flush_due(9, point, ready=True) == new and cp.flush_points == new


def test_no_flush_while_the_previous_checkpoint_is_in_flight(clock: Clock) -> None:
    cp = Checkpointer(None, cadence=Cadence(tokens=8, interval_s=1.0))  # type: ignore[arg-type]
    point = cp.flush_point()
    assert cp.flush_due(100, point, ready=False) is None
    assert cp.flush_points == point  # and starts no point either
    clock.now += 5
    assert cp.flush_due(100, point, ready=False) is None


def test_streaming_counts_open_streams() -> None:
    cp = Checkpointer(None)  # type: ignore[arg-type]
    with cp.streaming(), cp.streaming():
        assert cp.generating == 2
    with pytest.raises(RuntimeError), cp.streaming():
        raise RuntimeError
    assert cp.generating == 0


async def test_queued_chains_go_in_one_round_trip(counted: EventStore) -> None:
    cp = Checkpointer(counted)
    try:
        states = await asyncio.gather(*(cp.append(None, [f.submitted(f"r{i}")]) for i in range(5)))
        assert counted.batches == [5] and cp.round_trips == 1  # type: ignore[attr-defined]
        assert [s.rollout_id for s in states] == [f"r{i}" for i in range(5)]
        states = await asyncio.gather(*(cp.append(s, [f.started(s)]) for s in states))
        after = await asyncio.gather(
            *(cp.append(s, [f.tokens(s), f.tokens(s, offset=4, seq=s.seq + 2)]) for s in states)
        )
        assert counted.batches == [5, 5, 5]  # type: ignore[attr-defined]
        assert all(s.num_tokens == 8 and s.seq == 4 for s in after)
    finally:
        await cp.close()


async def test_what_arrives_during_a_round_trip_goes_in_the_next(counted: EventStore) -> None:
    cp = Checkpointer(counted)
    release = asyncio.Event()
    original = counted.append_many

    async def slow(chains):  # type: ignore[no-untyped-def]
        await release.wait()
        return await original(chains)

    counted.append_many = slow  # type: ignore[method-assign]
    try:
        first = asyncio.create_task(cp.append(None, [f.submitted("a")]))
        await asyncio.sleep(0.01)  # its round trip is in flight now
        later = [asyncio.create_task(cp.append(None, [f.submitted(r)])) for r in "bcd"]
        await asyncio.sleep(0.01)
        release.set()
        await asyncio.gather(first, *later)
        assert cp.round_trips == 2
    finally:
        await cp.close()


async def test_a_refused_chain_fails_alone(counted: EventStore) -> None:
    cp = Checkpointer(counted)
    try:
        ok = await cp.append(None, [f.submitted("ok")])
        good, bad = await asyncio.gather(
            cp.append(ok, [f.started(ok)]),
            cp.append(None, [f.submitted("ok")]),  # a second Submitted of the same rollout
            return_exceptions=True,
        )
        assert isinstance(good, RolloutState) and good.attempt == 1
        assert isinstance(bad, AppendRefused), bad
    finally:
        await cp.close()


async def test_a_redis_error_reaches_every_caller_of_the_round_trip(counted: EventStore) -> None:
    cp = Checkpointer(counted)

    async def down(chains):  # type: ignore[no-untyped-def]
        raise ConnectionError("redis is down")

    counted.append_many = down  # type: ignore[method-assign]
    try:
        results = await asyncio.gather(
            *(cp.append(None, [f.submitted(r)]) for r in "ab"), return_exceptions=True
        )
        assert all(isinstance(r, ConnectionError) for r in results)
        assert cp.round_trips == 0
    finally:
        await cp.close()


async def test_a_flush_point_gathers_every_streaming_rollout(counted: EventStore) -> None:
    cp = Checkpointer(counted, gather_s=5.0)
    sa = await cp.append(None, [f.submitted("a")])
    sb = await cp.append(None, [f.submitted("b")])
    sa, sb = await cp.append(sa, [f.started(sa)]), await cp.append(sb, [f.started(sb)])
    counted.batches.clear()  # type: ignore[attr-defined]
    try:
        with cp.streaming(), cp.streaming():
            cp.start_flush_point()
            first = asyncio.create_task(cp.append(sa, [f.tokens(sa)], gather=True))
            await asyncio.sleep(0.1)
            assert not first.done()  # waits for the other streaming rollout to join
            t0 = time.monotonic()
            await cp.append(sb, [f.tokens(sb)], gather=True)
            await first
            assert time.monotonic() - t0 < 1.0  # both in, no need to wait out gather_s
        assert counted.batches == [2]  # type: ignore[attr-defined]
    finally:
        await cp.close()


async def test_a_flush_point_waits_at_most_gather_s(counted: EventStore) -> None:
    cp = Checkpointer(counted, gather_s=0.3)
    s = await cp.append(None, [f.submitted("a")])
    s = await cp.append(s, [f.started(s)])
    try:
        with cp.streaming(), cp.streaming():  # the second stream never joins
            cp.start_flush_point()
            t0 = time.monotonic()
            await cp.append(s, [f.tokens(s)], gather=True)
            waited = time.monotonic() - t0
        assert 0.2 <= waited < 2.0
    finally:
        await cp.close()


async def test_an_urgent_append_ends_the_gather_wait(counted: EventStore) -> None:
    cp = Checkpointer(counted, gather_s=5.0)
    s = await cp.append(None, [f.submitted("a")])
    s = await cp.append(s, [f.started(s)])
    counted.batches.clear()  # type: ignore[attr-defined]
    try:
        with cp.streaming(), cp.streaming():
            cp.start_flush_point()
            gathered = asyncio.create_task(cp.append(s, [f.tokens(s)], gather=True))
            await asyncio.sleep(0.05)
            t0 = time.monotonic()
            await cp.append(None, [f.submitted("b")])  # a first event: goes out at once
            await gathered
            assert time.monotonic() - t0 < 1.0
        assert counted.batches == [2]  # type: ignore[attr-defined]
    finally:
        await cp.close()
