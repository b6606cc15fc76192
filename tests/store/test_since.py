"""Reading a rollout again from a state its reader holds (``store.since``), on fakeredis and a
real redis-server: the state read is ``load``'s whatever came since, in one round trip of the
entries since; a held state that is not provably the log's falls back to the whole read."""

from __future__ import annotations

from typing import Any

import pytest

from statemachine import CorruptRecord, codec
from store import EventStore, RolloutNotFound
from store.since import Held, load_held
from tests import factories as f
from tests.damage import damage_event


async def _turn_ended(store: EventStore, rid: str = "ep") -> Held:
    """An episode whose first turn ended at a tool call, held as the worker holds it."""
    s = await store.append(None, f.episode_submitted(rid))
    s = await store.append(s, f.started(s))
    s = await store.append(s, f.tokens(s, n=3))
    requested = f.requested(s)
    s = await store.append(s, requested)
    return Held(s, codec.encode(requested))


async def _whole_reads(monkeypatch: pytest.MonkeyPatch, store: EventStore) -> list[list[str]]:
    reads: list[list[str]] = []
    real = store.load_many

    async def counted(ids: Any) -> Any:
        reads.append(list(ids))
        return await real(ids)

    monkeypatch.setattr(store, "load_many", counted)
    return reads


async def test_a_held_turn_reads_as_load_does_whatever_came_since(
    store: EventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = await _turn_ended(store)
    whole = await _whole_reads(monkeypatch, store)
    s = held.state
    steps = [f.claimed, f.call_failed, f.claimed, lambda s: f.result(s, n=4), f.resumed,
             lambda s: f.tokens(s, n=2), f.requested]  # fmt: skip
    for step in steps:
        s = await store.append(s, step(s))
        [read] = await load_held(store, [held])
        assert read == await store.load("ep") == s
    assert whole == []
    # Nothing since: the held state itself, read back.
    again = Held(s, await _record_at(store, "ep", s.seq))
    assert await load_held(store, [again]) == [s] and whole == []


async def _record_at(store: EventStore, rid: str, seq: int) -> bytes:
    [(_, fields)] = await store.redis.xrange(store.keys.log(rid), f"0-{seq}", f"0-{seq}")
    record: bytes = fields[b"e"]
    return record


async def test_many_held_rollouts_are_read_in_one_round_trip_each_on_its_own(
    store: EventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = await _turn_ended(store, "a"), await _turn_ended(store, "b")
    s = await store.append(a.state, f.claimed(a.state))
    whole = await _whole_reads(monkeypatch, store)
    gone = Held(a.state.evolve(rollout_id="gone"), a.record)
    read = await load_held(store, [a, b, gone])
    assert read[:2] == [s, b.state] and isinstance(read[2], RolloutNotFound)
    assert whole == [["gone"]]  # only the one that is not provably the log's


async def test_a_rollout_submitted_again_under_its_id_is_read_whole(
    store: EventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = await _turn_ended(store)
    await store.redis.delete(store.keys.log("ep"), store.keys.snapshot("ep"))
    again = await _turn_ended(store)  # the same events, stamped at another time
    assert again.state.seq == held.state.seq and again.record != held.record
    whole = await _whole_reads(monkeypatch, store)
    assert await load_held(store, [held]) == [await store.load("ep")] and whole == [["ep"]]


async def test_a_held_state_the_head_does_not_match_is_read_whole(
    store: EventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = await _turn_ended(store)
    await store.append(held.state, f.claimed(held.state))
    whole = await _whole_reads(monkeypatch, store)
    # A state that claims to be the log's at that seq, but is not what the log folds to.
    wrong = Held(held.state.evolve(worker_id="someone-else"), held.record)
    assert await load_held(store, [wrong]) == [await store.load("ep")] and whole == [["ep"]]


async def test_damage_since_the_held_state_is_reported_as_the_whole_read_reports_it(
    store: EventStore,
) -> None:
    held = await _turn_ended(store)
    s = await store.append(held.state, f.claimed(held.state))
    await store.append(s, f.result(s))
    await damage_event(store.redis, store, "ep", s.seq + 1)
    [read] = await load_held(store, [held])
    assert isinstance(read, CorruptRecord)
