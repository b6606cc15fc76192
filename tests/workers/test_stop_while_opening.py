"""A stop that reaches the runner while it is opening an attempt (after ``Started``, before the
engine has the request) aborts that attempt, on the real CPU engine."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import redis.asyncio as aredis

from statemachine import Aborted, AbortReason, Status
from store import EventStore
from tests import factories as f
from tests.engine_pool import EnginePool
from workers.checkpoint import Checkpointer
from workers.engines.base import Chunk, EngineRequest
from workers.outcomes import Outcome
from workers.runner import RolloutRunner


class _StopWhileOpening:
    """The pool's CPU engine, with the worker's stop landing just before generate() runs."""

    def __init__(self, engine: Any, runner_box: list[RolloutRunner]) -> None:
        self._engine = engine
        self._box = runner_box

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate(self, request: EngineRequest) -> AsyncIterator[Chunk]:
        rid = request.request_id.split("#")[0]
        # What a SIGTERM or a weight update does at this moment: runner.stop() -> abort().
        await self._box[0].stop(rid, AbortReason.WEIGHT_UPDATE, "v0 -> v1")
        async for chunk in self._engine.generate(request):
            yield chunk


async def test_a_stop_while_the_attempt_opens_aborts_it(
    cpu_pool: EnginePool, tiny_dense_dir: Path, real_redis: aredis.Redis
) -> None:
    store = EventStore(real_redis)
    await store.append(None, f.submitted("r", max_tokens=64))
    box: list[RolloutRunner] = []
    engine = _StopWhileOpening(await cpu_pool.get(tiny_dense_dir), box)
    runner = RolloutRunner(store, Checkpointer(store), engine, "w")  # type: ignore[arg-type]
    box.append(runner)
    result = await runner.run("r")
    # Before: the CPU engine (like both vLLM engines) ignored the abort of a request it did
    # not know yet, and the rollout ran to the end: done, 64 tokens, on the old weights.
    assert result.outcome is Outcome.ABORTED
    assert result.state.status is Status.ABORTED and result.state.num_tokens == 0
    [abort] = [e for e in await store.events("r") if isinstance(e, Aborted)]
    assert abort.reason is AbortReason.WEIGHT_UPDATE
