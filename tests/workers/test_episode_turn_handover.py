"""The hand-over between an episode's turns on a real redis-server, when the environment is
faster than the worker winding up the last turn: a turn's run is not over when its call
becomes claimable (its lease drop and rq's books are still to come), and a quick tool's result
pushes the next turn's job meanwhile.

Found on bench/bench_episodes.py with its runner in a process of its own: the next turn's job,
delivered to the same worker while the last turn's run was still recorded there, was taken for
a duplicate of it and dropped, and the episode waited at ``next_turn`` with no job until the
stranded-rollout sweep requeued it. Its sibling: the last turn's lease drop, unconditional,
came after another worker had taken the next turn's lease, and removed that one."""

from __future__ import annotations

import asyncio
from typing import Any

import redis
import redis.asyncio as aredis

from statemachine import LIVE, Status
from statemachine.episode import ToolEffect, ToolSpec
from store import EventStore
from store.environment import EnvironmentClient
from store.leases import Leases
from store.redis_server import RedisServer
from tests import factories as f
from workers.checkpoint import Cadence, Checkpointer
from workers.engines.synthetic import SyntheticEngine
from workers.outcomes import Outcome
from workers.runner import RolloutRunner

VOCAB = 100
STOP = 7
CALC = (ToolSpec(name="calc", effect=ToolEffect.IDEMPOTENT),)


class GatedLeases(Leases):
    """Leases whose drop (and forget) waits at a gate: the last turn's run winding up."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.reached = asyncio.Event()
        self.gate = asyncio.Event()

    async def _wait(self) -> None:
        self.reached.set()
        await self.gate.wait()

    async def drop_many(self, rollout_ids: list[str]) -> list[None]:
        await self._wait()
        return await super().drop_many(rollout_ids)

    async def forget_many(self, rollout_ids: list[str]) -> list[None]:
        await self._wait()
        return await super().forget_many(rollout_ids)


def _runner(
    store: EventStore, engine: SyntheticEngine, worker: str, leases: Leases
) -> RolloutRunner:
    return RolloutRunner(store, Checkpointer(store), engine, worker, cadence=Cadence(tokens=8),
                         leases=leases, stepped=False)  # fmt: skip


async def test_the_next_turns_job_on_the_same_worker_waits_for_the_last_turns_run(
    real_redis: aredis.Redis, redis_server: RedisServer
) -> None:
    store = EventStore(real_redis)
    await _submit(store)
    leases = GatedLeases(real_redis, store.keys, holder="w1")
    runner = _runner(store, SyntheticEngine(vocab=VOCAB), "w1", leases)
    first = asyncio.create_task(runner.run("ep"))
    await asyncio.wait_for(leases.reached.wait(), 10)
    assert (await store.load("ep")).status is Status.AWAITING_TOOL
    await _serve(store, redis_server.url)
    # The next turn's job reaches this worker while the first turn's run winds up.
    second = asyncio.create_task(runner.run("ep"))
    await asyncio.sleep(0.2)
    leases.gate.set()
    assert (await asyncio.wait_for(first, 10)).outcome is Outcome.TOOL_CALL
    result = await asyncio.wait_for(second, 10)
    assert result.outcome is Outcome.TOOL_CALL  # was DUPLICATE: the turn never ran
    state = await store.load("ep")
    assert state.status is Status.AWAITING_TOOL and len(state.calls) == 2
    # No generation lease is left for an episode waiting on its tool, none in w1's set.
    assert await Leases(real_redis, store.keys).left_ms("ep") is None
    assert await leases.held_by("w1") == []


async def test_the_last_turns_lease_drop_leaves_the_next_turns_lease_alone(
    real_redis: aredis.Redis, redis_server: RedisServer
) -> None:
    store = EventStore(real_redis)
    await _submit(store)
    gated = GatedLeases(real_redis, store.keys, holder="w1")
    first = asyncio.create_task(_runner(store, SyntheticEngine(vocab=VOCAB), "w1", gated).run("ep"))
    await asyncio.wait_for(gated.reached.wait(), 10)
    await _serve(store, redis_server.url)
    # Another worker takes the next turn and generates it slowly.
    slow = SyntheticEngine(vocab=VOCAB, token_delay_s=0.02)
    leases = Leases(real_redis, store.keys, holder="w2")
    second = asyncio.create_task(_runner(store, slow, "w2", leases).run("ep"))
    for _ in range(500):
        state = await store.load("ep")
        if state.status in LIVE and state.worker_id == "w2":
            break
        await asyncio.sleep(0.01)
    assert state.status in LIVE and state.worker_id == "w2"
    # Now the first turn's run on w1 winds up.
    gated.gate.set()
    assert (await asyncio.wait_for(first, 10)).outcome is Outcome.TOOL_CALL
    left = await leases.left_ms("ep")
    assert left is not None and left > 0  # was None: w1's drop removed w2's lease
    assert (await asyncio.wait_for(second, 30)).outcome is Outcome.TOOL_CALL
    assert await leases.left_ms("ep") is None
    assert await gated.held_by("w1") == [] and await leases.held_by("w2") == []


async def _submit(store: EventStore) -> None:
    episode = {"tools": CALC, "tool_call_stop_token_ids": (STOP,), "max_turns": 4}
    await store.append(None, f.episode_submitted("ep", max_tokens=400, **episode))


async def _serve(store: EventStore, url: str) -> None:
    sync = redis.Redis.from_url(url)
    try:
        env = EnvironmentClient(store, sync)
        claim = await env.claim("default", "runner-1")
        assert claim is not None
        state = await env.record_result(claim, [11, 12, 13], seconds=0.001)
        assert state.status is Status.NEXT_TURN
    finally:
        sync.close()
