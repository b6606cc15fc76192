"""An episode's observation tokens get their routed experts from the next turn's prefill, where
the engine returns prompt routes: on the CPU engine every context token then has its row, equal
to what one forward pass over the whole context routes (a trainer's routing replay); on the
synthetic engine, which returns none, the observation rows stay absent. In-process runners on
a real redis-server, both ways of streaming (per-rollout streams and the stepper)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
import redis.asyncio as aredis

from statemachine import (
    AbortReason,
    FinishReason,
    RolloutRequest,
    RolloutState,
    SamplingParams,
    Status,
    commands,
)
from statemachine.episode import EpisodeSpec, ToolEffect, ToolSpec
from store import EventStore
from store.environment import EnvironmentClient
from store.redis_server import RedisServer
from store.results import RolloutResult
from tests.engine_pool import EnginePool
from tests.engines.routing import hf_routing
from tests.workers.episode_helpers import observe
from tests.workers.helpers import until
from workers.checkpoint import Cadence, Checkpointer
from workers.engines.base import Chunk, Engine, EngineRequest
from workers.engines.synthetic import SyntheticEngine
from workers.outcomes import Outcome
from workers.runner import RolloutRunner

pytestmark = pytest.mark.redis_server

K = 32  # tokens per turn of the tiny tool-turn model
TURNS = 3
PROMPT = (5, 17, 300, 44, 9)


def _request(stop: int, prompt: tuple[int, ...] = PROMPT) -> RolloutRequest:
    return RolloutRequest(
        prompt_token_ids=prompt,
        sampling=SamplingParams(max_tokens=400, temperature=0.0),
        episode=EpisodeSpec(
            tool_call_stop_token_ids=(stop,),
            tools=(ToolSpec(name="calc", effect=ToolEffect.IDEMPOTENT),),
            max_turns=TURNS,
        ),
    )


@pytest.fixture(scope="module")
def moe_turn_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from workers.demo.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("moe-turn"), moe=True, tool_turn=K)


@pytest.fixture
def sync(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


class Recording:
    """Wraps an engine's ``generate`` and ``add`` to remember every request sent."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.requests: list[EngineRequest] = []
        self._generate, self._add = engine.generate, engine.add

        async def generate(request: EngineRequest) -> AsyncIterator[Chunk]:
            self.requests.append(request)
            async for chunk in self._generate(request):
                yield chunk

        async def add(request: EngineRequest) -> None:
            self.requests.append(request)
            await self._add(request)

        engine.generate, engine.add = generate, add

    def restore(self) -> None:
        del self.engine.generate, self.engine.add


def _runner(store: EventStore, engine: Engine, stepped: bool) -> RolloutRunner:
    return RolloutRunner(
        store, Checkpointer(store), engine, "w1", cadence=Cadence(tokens=4), stepped=stepped
    )


async def _serve_call(env: EnvironmentClient) -> RolloutState:
    claim = await env.claim("default", "runner-1")
    assert claim is not None
    turn = json.loads(claim.arguments)["token_ids"]
    return await env.record_result(claim, observe(turn), seconds=0.01, env_revision="r")


async def _episode(store: EventStore, env: EnvironmentClient, runner: RolloutRunner) -> None:
    for turn in range(TURNS):
        assert (await runner.run("ep")).outcome is Outcome.TOOL_CALL
        if turn < TURNS - 1:
            assert (await _serve_call(env)).status is Status.NEXT_TURN


def _check_against_a_forward(state: RolloutState, model_dir: Path) -> None:
    """Every context token has its row, and the rows are a forward over prompt + context."""
    routes, present = state.context_routes()
    assert routes is not None and present is not None
    context = state.context_token_ids.tolist()
    assert present.all() and len(routes) == len(context)
    # Row j of the context is the forward at the position before its token.
    expected = hf_routing(model_dir, [*PROMPT, *context])[len(PROMPT) - 1 : -1]
    np.testing.assert_array_equal(routes, expected)
    # The trainer's result carries them so (routes_present all 1, observations included).
    result = RolloutResult.from_state(state)
    assert result.routes_present is not None and result.routes_present.all()
    np.testing.assert_array_equal(result.routed_experts, expected)  # type: ignore[arg-type]
    assert result.loss_mask is not None and (result.loss_mask == 0).sum() == 4 * (TURNS - 1)


@pytest.mark.slow
@pytest.mark.parametrize("stepped", [False, True], ids=["streams", "steps"])
async def test_every_context_token_has_the_route_a_forward_over_the_context_gives(
    real_redis: aredis.Redis,
    sync: redis.Redis,
    cpu_pool: EnginePool,
    moe_turn_dir: Path,
    stepped: bool,
) -> None:
    from workers.demo.tiny_model import tool_call_token

    store = EventStore(real_redis)
    env = EnvironmentClient(store, sync)
    await store.append(None, commands.submit("ep", _request(tool_call_token(K))))
    engine = await cpu_pool.get(moe_turn_dir)
    recording = Recording(engine)
    try:
        await _episode(store, env, _runner(store, engine, stepped))
    finally:
        recording.restore()
    state = await store.load("ep")
    assert state == await store.replay("ep")  # the snapshot's reader builds the same routes
    assert state.status is Status.DONE and state.finish_reason is FinishReason.MAX_TURNS
    assert state.turns == ((0, K), (K + 4, 2 * K + 4), (2 * K + 8, 3 * K + 8))
    # Turns 2 and 3 asked for their observation's rows (the last 4 prompt tokens), turn 1 none.
    asked = [(r.prompt_token_ids, r.prompt_routes_from) for r in recording.requests]
    assert [start for _, start in asked] == [None] + [len(p) - 4 for p, _ in asked[1:]]
    # Each observation's rows were recorded once, on its next turn's first chunk.
    carrying = [c for c in state.chunks if c.observation_routes is not None]
    assert [c.offset for c in carrying] == [K, 2 * K]
    _check_against_a_forward(state, moe_turn_dir)


@pytest.mark.slow
async def test_a_turn_resumed_mid_way_does_not_record_them_twice(
    real_redis: aredis.Redis, sync: redis.Redis, cpu_pool: EnginePool, moe_turn_dir: Path
) -> None:
    """Turn 2 stopped after its first checkpoint (its observation's rows saved with it): the
    attempt that resumes it asks for none, and the context's routes are still exact."""
    from workers.demo.tiny_model import tool_call_token

    store = EventStore(real_redis)
    env = EnvironmentClient(store, sync)
    await store.append(None, commands.submit("ep", _request(tool_call_token(K))))
    engine = await cpu_pool.get(moe_turn_dir)
    runner = _runner(store, engine, stepped=False)
    assert (await runner.run("ep")).outcome is Outcome.TOOL_CALL
    await _serve_call(env)
    recording = Recording(engine)
    try:
        turn_2 = asyncio.create_task(runner.run("ep"))

        async def saved_some() -> bool:
            return (await store.load("ep")).num_tokens > K

        await until(saved_some, timeout=60, what="turn 2 saved nothing", every=0.002)
        await runner.stop("ep", AbortReason.SHUTDOWN)
        assert (await turn_2).outcome is Outcome.ABORTED
        stopped = await store.load("ep")
        assert K < stopped.num_tokens < 2 * K, "turn 2 ended before it could be stopped"
        assert (await runner.run("ep")).outcome is Outcome.TOOL_CALL
        await _serve_call(env)
        assert (await runner.run("ep")).outcome is Outcome.TOOL_CALL
    finally:
        recording.restore()
    starts = [r.prompt_routes_from for r in recording.requests]
    assert starts[0] is not None and starts[1] is None and starts[2] is not None
    state = await store.load("ep")
    assert state.aborts == 1 and state.status is Status.DONE
    carrying = [c.offset for c in state.chunks if c.observation_routes is not None]
    assert carrying == [K, 2 * K]
    _check_against_a_forward(state, moe_turn_dir)


@pytest.mark.parametrize("stepped", [False, True], ids=["streams", "steps"])
async def test_an_engine_without_prompt_routes_leaves_the_observation_rows_absent(
    real_redis: aredis.Redis, sync: redis.Redis, stepped: bool
) -> None:
    store = EventStore(real_redis)
    env = EnvironmentClient(store, sync)
    await store.append(None, commands.submit("ep", _request(7, prompt=(5, 17, 30, 44, 9))))
    engine = SyntheticEngine(vocab=100, tokens_per_chunk=4, experts=8)
    recording = Recording(engine)
    await _episode(store, env, _runner(store, engine, stepped))
    # It was asked (turns 2 and 3) and had none to give.
    assert [r.prompt_routes_from is not None for r in recording.requests] == [False, True, True]
    state = await store.load("ep")
    assert all(c.observation_routes is None for c in state.chunks)
    routes, present = state.context_routes()
    assert routes is not None and present is not None
    np.testing.assert_array_equal(present, state.loss_mask.astype(bool))
    assert not routes[~present].any()
    result = RolloutResult.from_state(state)
    np.testing.assert_array_equal(result.routes_present, present)  # type: ignore[arg-type]
