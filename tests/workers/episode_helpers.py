"""Episodes for the worker tests: an in-process environment loop with a deterministic tool,
and the same episode run directly on an engine, uninterrupted, as the reference."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable

import redis

from examples import calculator_episode
from statemachine import RolloutRequest
from store.client import RolloutClient
from store.environment import EnvironmentClient
from workers.engines.base import Engine


def observe(turn: list[int]) -> list[int]:
    """The tests' tool: 4 observation tokens that depend only on the turn, ids 3..99 (valid in
    every test vocabulary, and never a tiny tool-turn model's turn tokens)."""
    return [(sum(turn) + 5 * j) % 97 + 3 for j in range(4)]


@contextlib.asynccontextmanager
async def environment(
    client: RolloutClient,
    url: str,
    queue: str = "default",
    gate: asyncio.Event | None = None,
    tool: Callable[[list[int]], list[int]] = observe,
) -> AsyncIterator[EnvironmentClient]:
    """A runner serving every call of ``queue`` with ``tool`` while the block runs; with a
    ``gate``, each call's result waits until the gate is set. ``url``: the queue's Redis
    (where the next turns' jobs go), apart from the store's if ``client``'s is."""
    sync = redis.Redis.from_url(url)
    env = EnvironmentClient(client.store, sync, queue_apart=client.queue_apart)
    done = asyncio.Event()

    async def serve() -> None:
        while not done.is_set():
            claim = await env.claim(queue, "test-env", timeout_s=0.1)
            if claim is None:
                continue
            if gate is not None:
                await gate.wait()
            turn = json.loads(claim.arguments)["token_ids"]
            await env.record_result(claim, tool(turn), seconds=0.001, env_revision="r")

    task = asyncio.create_task(serve())
    try:
        yield env
    finally:
        done.set()
        await task
        sync.close()


async def direct_episode(
    engine: Engine,
    request: RolloutRequest,
    turns: int,
    tool: Callable[[list[int]], list[int]] = observe,
) -> tuple[list[int], list[int]]:
    """The episode on ``engine`` alone, uninterrupted, with the tests' tool (the example's
    reference: ``examples.calculator_episode.direct_episode``)."""
    return await calculator_episode.direct_episode(engine, request, turns, tool)
