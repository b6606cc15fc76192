"""Failures a worker survives, in-process on a real redis-server: which aborted attempts count
against a rollout's engine-error budget; a published checkpoint the engine refuses at start."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import redis.asyncio as aredis

from statemachine import Aborted, AbortReason, Status
from store import EventStore
from store.connection import connect_sync
from store.queue import enqueue_rollouts, rollout_queue
from store.redis_server import RedisServer
from store.weights import WeightRegistry
from tests import factories as f
from workers.engines.errors import WeightLoadError
from workers.engines.synthetic import SyntheticEngine
from workers.worker import Worker, WorkerConfig

POISON = 7


async def _history(store: EventStore, rid: str, prompt: tuple[int, ...], aborts: list) -> None:
    """A rollout that already went through `aborts` (reason, detail) attempts."""
    s = await store.append(None, f.submitted(rid, max_tokens=8, prompt=prompt))
    for reason, detail in aborts:
        s = await store.append(s, (f.started if s.attempt == 0 else f.resumed)(s))
        s = await store.append(
            s,
            Aborted(rollout_id=rid, seq=s.seq + 1, attempt=s.attempt, reason=reason, detail=detail),
        )


async def _run_burst(server: RedisServer, engine: SyntheticEngine, rids: list[str]) -> None:
    enqueue_rollouts(rollout_queue(connect_sync(server.url)), rids)
    config = WorkerConfig(redis_url=server.url, burst=True, max_engine_attempts=3)
    await Worker(config, engine).run()


async def test_only_the_engines_own_errors_count_against_the_attempt_budget(
    server: RedisServer,
) -> None:
    store = EventStore(aredis.Redis.from_url(server.url))
    not_its_fault = [
        (AbortReason.WEIGHT_UPDATE, "mode=abort, v0 -> v1"),
        (AbortReason.SHUTDOWN, ""),
        (AbortReason.WORKER_LOST, "taken over by w9"),
        (AbortReason.ENGINE_DEAD, "EngineDead: engine core exited with -9"),
    ]
    # Four attempts already ended, none by the rollout's fault: it still gets 3 of its own.
    await _history(store, "poisoned", (1, POISON, 2), not_its_fault)
    # Its healthy twin with the same history finishes normally.
    await _history(store, "healthy", (1, 2, 3), not_its_fault)
    await _run_burst(server, SyntheticEngine(poison_token=POISON), ["poisoned", "healthy"])

    poisoned = await store.load("poisoned")
    assert poisoned.status is Status.FAILED
    assert "poison token" in (poisoned.error or "")
    own = [
        e
        for e in await store.events("poisoned")
        if isinstance(e, Aborted) and e.reason is AbortReason.ENGINE_ERROR
    ]
    assert [e.detail.split(":")[0] for e in own] == ["EngineError"] * 3
    assert poisoned.attempt == 4 + 3
    healthy = await store.load("healthy")
    assert healthy.status is Status.DONE and healthy.num_tokens == 8
    assert np.array_equal(healthy.token_ids, (6 + np.arange(8)) % 32_000)


async def test_a_rollout_fails_after_max_engine_attempts_of_its_own(server: RedisServer) -> None:
    store = EventStore(aredis.Redis.from_url(server.url))
    await _history(store, "fresh", (POISON,), [])
    await _run_burst(server, SyntheticEngine(poison_token=POISON), ["fresh"])
    state = await store.load("fresh")
    assert state.status is Status.FAILED and state.attempt == 3


class PickyEngine(SyntheticEngine):
    """Loads only checkpoint paths that exist, like a real engine."""

    async def load_weights(self, source: str, version: int) -> None:
        if not Path(source).is_dir():
            raise WeightLoadError(f"cannot load checkpoint {source}")
        await super().load_weights(source, version)


async def test_a_worker_starting_behind_a_refused_checkpoint_serves_on_what_it_has(
    server: RedisServer, tmp_path: Path
) -> None:
    # Before: catch_up raised, so a supervised worker restarted into the same error forever.
    client = aredis.Redis.from_url(server.url)
    store = EventStore(client)
    await WeightRegistry(client).publish(1, str(tmp_path / "missing"))
    await _history(store, "r", (1, 2, 3), [])
    engine = PickyEngine()
    config = WorkerConfig(redis_url=server.url, burst=True)
    enqueue_rollouts(rollout_queue(connect_sync(server.url)), ["r"])
    worker = Worker(config, engine)
    await worker.run()
    state = await store.load("r")
    assert state.status is Status.DONE and (state.weight_versions == 0).all()
    assert worker.weights is not None and worker.weights.refused == 1
    assert engine.weight_version == 0
