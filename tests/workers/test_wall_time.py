"""An episode's wall time on a worker, in-process on a real redis-server: a turn still
generating when ``max_wall_seconds`` run out is cut there, its tokens so far kept and the
episode finished ``wall_time``; an episode whose wall time ran out while it waited for a worker
ends when one takes it, without the engine. Both ways a worker consumes its engine."""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import pytest
import redis.asyncio as aredis

from statemachine import FinishReason, SamplingParams, Status
from store import EventStore
from tests import factories as f
from workers.checkpoint import Cadence, Checkpointer
from workers.engines.base import EngineRequest, join_chunks
from workers.engines.synthetic import SyntheticEngine
from workers.outcomes import Outcome
from workers.runner import RolloutRunner

VOCAB = 5000
STOP = VOCAB - 1  # the tool-call token: ~5,000 tokens away, so a turn runs until it is cut


def _runner(store: EventStore, engine: SyntheticEngine, stepped: bool) -> RolloutRunner:
    return RolloutRunner(
        store, Checkpointer(store), engine, "w1", cadence=Cadence(tokens=8), stepped=stepped
    )


async def _uninterrupted(engine: SyntheticEngine, n: int) -> list[int]:
    """The first ``n`` tokens the engine gives the episode's prompt, uncut."""
    request = EngineRequest(
        request_id="reference", prompt_token_ids=(1, 2, 3), sampling=SamplingParams(max_tokens=n)
    )
    return join_chunks([c async for c in engine.generate(request)]).token_ids.tolist()


@pytest.mark.parametrize("stepped", [False, True], ids=["streams", "steps"])
async def test_a_turn_still_generating_at_the_deadline_is_cut_and_kept(
    real_redis: aredis.Redis, stepped: bool
) -> None:
    store = EventStore(real_redis)
    submitted = f.episode_submitted(
        "ep", max_tokens=4000, tool_call_stop_token_ids=(STOP,), max_wall_seconds=0.6
    )
    await store.append(None, submitted)
    engine = SyntheticEngine(vocab=VOCAB, tokens_per_chunk=1, token_delay_s=0.005)
    t0 = time.monotonic()
    result = await _runner(store, engine, stepped).run("ep")
    took = time.monotonic() - t0
    assert result.outcome is Outcome.FINISHED
    state = await store.load("ep")
    assert state.status is Status.DONE and state.finish_reason is FinishReason.WALL_TIME
    # Cut near the deadline (0.6 s after submission), not at the turn's end (~25 s away).
    assert took < 5.0 and 0 < state.num_tokens < 1000
    # Every token generated before the cut is kept, exactly as an uncut run gives them.
    assert state.token_ids.tolist() == await _uninterrupted(engine, state.num_tokens)
    assert np.all(state.weight_versions == 0) and state.calls == ()


@pytest.mark.parametrize("stepped", [False, True], ids=["streams", "steps"])
async def test_an_episode_out_of_wall_time_before_a_worker_took_it_ends_without_the_engine(
    real_redis: aredis.Redis, stepped: bool
) -> None:
    store = EventStore(real_redis)
    submitted = f.episode_submitted("ep", tool_call_stop_token_ids=(STOP,), max_wall_seconds=5.0)
    await store.append(None, replace(submitted, at=time.time() - 10))  # waited 10 s in a queue
    engine = SyntheticEngine(vocab=VOCAB)
    result = await _runner(store, engine, stepped).run("ep")
    assert result.outcome is Outcome.FINISHED
    state = await store.load("ep")
    assert state.status is Status.DONE and state.finish_reason is FinishReason.WALL_TIME
    assert state.num_tokens == 0


async def test_a_plain_rollout_has_no_wall_time(real_redis: aredis.Redis) -> None:
    store = EventStore(real_redis)
    await store.append(None, replace(f.submitted("r", max_tokens=16), at=time.time() - 1e6))
    result = await _runner(store, SyntheticEngine(vocab=VOCAB), False).run("r")
    state = await store.load("r")
    assert result.outcome is Outcome.FINISHED and state.finish_reason is FinishReason.LENGTH
    assert state.num_tokens == 16
