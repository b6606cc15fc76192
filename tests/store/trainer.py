"""What the trainer-API tests share: a client on the session's redis-server, a stand-in for a
worker that writes the events a real one would (through the same store and commands), and a
dump of every key to prove that a refused call wrote nothing."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import redis.asyncio as aredis

from statemachine import FinishReason, RolloutState, commands
from statemachine.commands import NewTokens
from store import EventStore
from store.client import RolloutClient


def tokens(n: int, start: int = 10, version: int = 0) -> NewTokens:
    return NewTokens(
        token_ids=np.arange(start, start + n, dtype=np.int32),
        logprobs=np.full(n, -0.5, np.float32),
        weight_versions=np.full(n, version, np.int64),
    )


async def start(store: EventStore, rid: str, worker: str = "w") -> RolloutState:
    state = await store.load(rid)
    for event in commands.begin(state, worker_id=worker, weight_version=0, weight_mode="abort",
                                model=""):  # fmt: skip
        state = await store.append(state, event)
    return state


async def checkpoint(store: EventStore, state: RolloutState, n: int) -> RolloutState:
    return await store.append(state, commands.checkpoint(state, tokens(n, 10 + state.num_tokens)))


async def finish(store: EventStore, rid: str, n: int = 4) -> RolloutState:
    """Run rollout ``rid`` start to end as a worker would: Started, tokens, Finished."""
    state = await start(store, rid)
    for event in commands.finish(state, FinishReason.LENGTH, tokens=tokens(n)):
        state = await store.append(state, event)
    return state


async def dump(redis: aredis.Redis) -> dict[bytes, Any]:
    """Every key with its type, whether it expires, and its content. (Not DUMP: a hash's
    serialization follows its table's iteration order, which reads may change by rehashing.)"""
    out = {}
    for key in sorted(await redis.keys("*")):
        kind = (await redis.type(key)).decode()
        read = {
            "string": lambda k: redis.get(k),
            "hash": lambda k: redis.hgetall(k),
            "list": lambda k: redis.lrange(k, 0, -1),
            "set": lambda k: redis.smembers(k),
            "zset": lambda k: redis.zrange(k, 0, -1, withscores=True),
            "stream": lambda k: redis.xrange(k),
        }[kind]
        out[key] = (kind, await redis.ttl(key) > 0, await read(key))
    return out


def ack_before_the_load(
    monkeypatch: pytest.MonkeyPatch, acker: RolloutClient, **what: object
) -> list[list[str]]:
    """Make ``acker.ack(**what)`` land between a results block's ``XREAD`` and its
    ``load_many`` (the window issue 28 hit 3 of 3 rounds), once; returns the loads asked."""
    real = EventStore.load_many
    asked: list[list[str]] = []

    async def load_many(self: EventStore, ids: Sequence[str]) -> list[Any]:
        asked.append(list(ids))
        if len(asked) == 1:
            await acker.ack(**what)  # type: ignore[arg-type]
        return await real(self, ids)

    monkeypatch.setattr(EventStore, "load_many", load_many)
    return asked
