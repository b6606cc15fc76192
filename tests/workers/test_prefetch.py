"""A worker takes its next job when a rollout is nearly done, never putting more than its N
requests on the engine (``WorkerConfig.prefetch_tokens``, ``EnginePlace``; real redis-server)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aredis
from redis import Redis

from statemachine import Status
from store import EventStore
from store.queue import enqueue_rollouts, rollout_queue
from store.redis_server import RedisServer
from tests import factories as f
from workers.checkpoint import Checkpointer
from workers.engines.base import Chunk, EngineRequest, Step
from workers.engines.synthetic import SyntheticEngine
from workers.outcomes import Outcome
from workers.runner import RolloutRunner
from workers.worker import Worker, WorkerConfig

PROMPT = (1, 2, 3)  # tests.factories' default prompt


def expected(n: int, vocab: int = 32_000) -> list[int]:
    return [(sum(PROMPT) + i) % vocab for i in range(n)]


class Place:
    """Records how many tokens the engine had made for the rollout at each call."""

    def __init__(self, made: Any) -> None:
        self.made = made
        self.calls: list[tuple[str, int]] = []

    async def enter(self) -> None:
        self.calls.append(("enter", self.made()))

    def nearly_free(self) -> None:
        self.calls.append(("nearly_free", self.made()))

    def free(self) -> None:
        self.calls.append(("free", self.made()))


class CountedGenerate(SyntheticEngine):
    """Counts the tokens its ``generate`` streams yielded (and so runs without steps)."""

    made = 0

    async def generate(self, request: EngineRequest) -> AsyncIterator[Chunk]:
        async for chunk in super().generate(request):
            self.made += len(chunk.token_ids)
            yield chunk


@pytest.mark.parametrize("chunk", [1, 5])
@pytest.mark.parametrize("stepped", [True, False])
async def test_the_place_is_nearly_free_with_prefetch_tokens_left(
    real_redis: aredis.Redis, stepped: bool, chunk: int
) -> None:
    store = EventStore(real_redis)
    engine: SyntheticEngine = (SyntheticEngine if stepped else CountedGenerate)(
        tokens_per_chunk=chunk
    )
    run = RolloutRunner(
        store, Checkpointer(store), engine, "w", stepped=stepped, prefetch_tokens=8
    )  # fmt: skip

    def made() -> int:
        if run.stepper is not None:
            return min(run.stepper.steps * chunk, n)  # one request: a step is its chunk
        assert isinstance(engine, CountedGenerate)
        return engine.made

    # 40 tokens: told once 32 are made (the first chunk that reaches 32: 35 with chunks of 5).
    n = 40
    await store.append(None, f.submitted("long", max_tokens=n))
    place = Place(made)
    result = await run.run("long", place=place)
    assert result.outcome is Outcome.FINISHED
    assert result.state.token_ids.tolist() == expected(n)
    told = -(-(n - 8) // chunk) * chunk
    assert place.calls == [("enter", 0), ("nearly_free", told), ("free", n)]

    # Shorter than the prefetch: nearly free as soon as it is on the engine.
    n = 5
    if isinstance(engine, CountedGenerate):
        engine.made = 0
    if run.stepper is not None:
        run.stepper.steps = 0
    await store.append(None, f.submitted("short", max_tokens=n))
    place = Place(made)
    assert (await run.run("short", place=place)).outcome is Outcome.FINISHED
    assert place.calls == [("enter", 0), ("nearly_free", 0), ("free", n)]


async def test_without_prefetch_a_place_is_only_freed(real_redis: aredis.Redis) -> None:
    store = EventStore(real_redis)
    run = RolloutRunner(store, Checkpointer(store), SyntheticEngine(), "w")
    await store.append(None, f.submitted("r", max_tokens=20))
    place = Place(lambda: 0)
    assert (await run.run("r", place=place)).outcome is Outcome.FINISHED
    assert [c for c, _ in place.calls] == ["enter", "free"]


class Watched(SyntheticEngine):
    """Records, at every engine step, its requests in flight and the worker's rollouts."""

    worker: Worker | None = None
    on_engine = 0
    active = 0

    def _step(self) -> Step:
        self.on_engine = max(self.on_engine, len(self._ids))
        if self.worker is not None:
            self.active = max(self.active, len(self.worker.runner.active))
        return super()._step()


async def test_a_worker_begins_its_next_rollouts_early_yet_keeps_n_on_the_engine(
    server: RedisServer,
) -> None:
    client = aredis.Redis.from_url(server.url)
    store = EventStore(client)
    rids = [f"r{i}" for i in range(6)]
    for rid in rids:
        await store.append(None, f.submitted(rid, max_tokens=24))
    enqueue_rollouts(rollout_queue(Redis.from_url(server.url)), rids)
    # 20 ms a token: the 8 last tokens of a rollout (160 ms) leave ample time to take,
    # load, lease and begin the next one, even on a loaded machine.
    engine = Watched(tokens_per_chunk=1, token_delay_s=0.02)
    cfg = WorkerConfig(redis_url=server.url, max_concurrency=2, burst=True, prefetch_tokens=8)
    worker = engine.worker = Worker(cfg, engine)
    await asyncio.wait_for(worker.run(), 60)
    for rid in rids:
        state = await store.load(rid)
        assert state.status is Status.DONE and state.attempt == 1
        assert state.token_ids.tolist() == expected(24)
    assert engine.on_engine == 2  # never more than max_concurrency requests on the engine
    assert engine.active > 2  # but the next ones were begun while those finished
    assert worker.places.refills == 4  # 6 rollouts through 2 places
    await client.aclose()
