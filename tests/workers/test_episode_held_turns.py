"""A worker holds an episode between its turns (``RolloutRunner(keep_turns=...)``, on a real
redis-server): the next turn here reads only the log's entries since its last turn, not the
whole log, and runs from exactly the context a whole read gives, whoever ran the turns in
between; a held state that is not the log's is read whole; at most ``keep_turns`` are held."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis
import redis.asyncio as aredis

from statemachine import Status
from store import EventStore
from store.environment import EnvironmentClient
from store.redis_server import RedisServer
from tests.workers.test_episode_turns import (
    VOCAB,
    RecordingEngine,
    _reference,
    _serve_call,
    _submit,
)
from workers.checkpoint import Cadence, Checkpointer
from workers.outcomes import Outcome
from workers.runner import RolloutRunner


@pytest.fixture
def sync(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


def _runner(store: EventStore, engine: RecordingEngine, name: str = "w1") -> RolloutRunner:
    return RolloutRunner(
        store, Checkpointer(store), engine, name, cadence=Cadence(tokens=8), keep_turns=2
    )


def _whole_reads(monkeypatch: pytest.MonkeyPatch, store: EventStore) -> list[list[str]]:
    reads: list[list[str]] = []
    real = store.load_many

    async def counted(ids: Any) -> Any:
        reads.append(list(ids))
        return await real(ids)

    monkeypatch.setattr(store, "load_many", counted)
    return reads


async def test_turns_after_the_first_read_only_what_came_since(
    real_redis: aredis.Redis, sync: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = EventStore(real_redis)
    env = EnvironmentClient(store, sync)
    await _submit(store, max_turns=5)
    whole = _whole_reads(monkeypatch, store)
    engine = RecordingEngine(vocab=VOCAB, tokens_per_chunk=4)
    runner = _runner(store, engine)
    for _ in range(4):
        assert (await runner.run("ep")).outcome is Outcome.TOOL_CALL
        await _serve_call(env)
    assert whole == [["ep"]]  # the first turn's read only
    for turn, request in enumerate(engine.requests):
        assert request.prompt_token_ids == (1, 2, 3, *_reference(turn)[0])
    state = await store.load("ep")
    assert state.context_token_ids.tolist() == _reference(4)[0]
    assert state == await store.replay("ep") and state.status is Status.NEXT_TURN


async def test_a_turn_another_worker_ran_meanwhile_is_folded_in(
    real_redis: aredis.Redis, sync: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = EventStore(real_redis)
    env = EnvironmentClient(store, sync)
    await _submit(store, max_turns=5)
    engine = RecordingEngine(vocab=VOCAB, tokens_per_chunk=4)
    here, there = _runner(store, engine, "w1"), _runner(store, engine, "w2")
    assert (await here.run("ep")).outcome is Outcome.TOOL_CALL
    await _serve_call(env)
    assert (await there.run("ep")).outcome is Outcome.TOOL_CALL  # its turn, its entries
    await _serve_call(env)
    whole = _whole_reads(monkeypatch, store)
    assert (await here.run("ep")).outcome is Outcome.TOOL_CALL
    assert whole == []  # folded from turn 1's state: turn 2's entries are checked one by one
    assert engine.requests[-1].prompt_token_ids == (1, 2, 3, *_reference(2)[0])
    assert (await store.load("ep")).calls[-1].turn == 2


async def test_a_held_turn_that_is_not_the_logs_is_read_whole(
    real_redis: aredis.Redis, sync: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = EventStore(real_redis)
    env = EnvironmentClient(store, sync)
    await _submit(store, max_turns=5)
    engine = RecordingEngine(vocab=VOCAB, tokens_per_chunk=4)
    runner = _runner(store, engine)
    assert (await runner.run("ep")).outcome is Outcome.TOOL_CALL
    # The episode is gone and submitted again under its id (acknowledged, then the same
    # batch submitted anew): its log's records are other records at the same seqs.
    await real_redis.delete(store.keys.log("ep"), store.keys.snapshot("ep"))
    await _submit(store, max_turns=5)
    again = _runner(store, RecordingEngine(vocab=VOCAB, tokens_per_chunk=4), "w2")
    assert (await again.run("ep")).outcome is Outcome.TOOL_CALL
    await _serve_call(env)
    whole = _whole_reads(monkeypatch, store)
    assert (await runner.run("ep")).outcome is Outcome.TOOL_CALL
    assert whole == [["ep"]]  # its held turn's record is not the log's: read whole
    assert engine.requests[-1].prompt_token_ids == (1, 2, 3, *_reference(1)[0])


async def test_at_most_keep_turns_episodes_are_held(real_redis: aredis.Redis) -> None:
    store = EventStore(real_redis)
    engine = RecordingEngine(vocab=VOCAB, tokens_per_chunk=4)
    runner = _runner(store, engine)  # keep_turns=2
    for rid in ("a", "b", "c"):
        await _submit(store, rid)
        assert (await runner.run(rid)).outcome is Outcome.TOOL_CALL
    assert list(runner._held) == ["b", "c"]  # the oldest went first
    plain = RolloutRunner(store, Checkpointer(store), engine, "w3")  # keep_turns=0: none
    await _submit(store, "d")
    assert (await plain.run("d")).outcome is Outcome.TOOL_CALL and plain._held == {}
