"""A stepped attempt generates while its lease and begin are in flight (runner
``_generate_while_opening``), on a real redis-server: nothing it generated is saved before the
attempt is open, and a refused begin leaves no token of it anywhere."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import numpy as np
import redis.asyncio as aredis

from statemachine import RolloutState, Started, Status, TokensAppended
from store import EventStore
from store.leases import Leases
from tests import factories as f
from workers.checkpoint import Checkpointer
from workers.engines.synthetic import SyntheticEngine
from workers.runner import Cadence, Outcome, RolloutRunner


def _runner(store: EventStore, engine: SyntheticEngine, leases: Leases | None = None):
    return RolloutRunner(
        store, Checkpointer(store), engine, "w", cadence=Cadence(tokens=8), leases=leases
    )


async def _until_steps(runner: RolloutRunner, n: int) -> None:
    """Until the engine has made ``n`` steps (5 s at most: a begin that waited for nothing
    but its own round trips would never see one)."""

    async def wait() -> None:
        assert runner.stepper is not None
        while runner.stepper.steps < n:
            await asyncio.sleep(0)

    await asyncio.wait_for(wait(), 5.0)


def _hold_begin(
    runner: RolloutRunner, before: Callable[[RolloutState], Awaitable[None]]
) -> list[int]:
    """Run ``before`` ahead of the runner's begin; returns the engine steps seen at each
    begin (the stepper's count when the begin was sent)."""
    begin, seen = runner._begin, []

    async def held(state: RolloutState, **kw):  # type: ignore[no-untyped-def]
        await before(state)
        assert runner.stepper is not None
        seen.append(runner.stepper.steps)
        return await begin(state, **kw)

    runner._begin = held  # type: ignore[method-assign]
    return seen


async def test_tokens_generated_while_opening_are_saved_after_the_begin(
    real_redis: aredis.Redis,
) -> None:
    store, leases = EventStore(real_redis), Leases(real_redis, holder="w")
    await store.append(None, f.submitted("o", max_tokens=64))
    engine = SyntheticEngine(tokens_per_chunk=1)
    runner = _runner(store, engine, leases)
    steps_at_begin: list[int] = []

    async def until_generating(state: RolloutState) -> None:
        # The begin goes out only once the engine has produced 20 of its tokens.
        await _until_steps(runner, 20)
        steps_at_begin.append(runner.stepper.steps)
        assert await leases.expiry("o") is not None  # lease first, attempt second

    seen = _hold_begin(runner, until_generating)
    result = await runner.run("o")

    assert result.outcome is Outcome.FINISHED and result.state.status is Status.DONE
    assert seen and seen[0] >= 20
    events = await store.events("o")
    assert isinstance(events[1], Started) and events[1].attempt == 1
    first = next(e for e in events if isinstance(e, TokensAppended))
    # Held in the stepper until the attempt was open, then saved together: more than one
    # cadence's worth in the first checkpoint, which follows the Started.
    assert first.seq == 3 and len(first.token_ids) >= 20
    # Exactly the engine's tokens, in order, none twice (the synthetic engine is resume-exact).
    reference = SyntheticEngine(tokens_per_chunk=64)
    [chunk] = [c async for c in reference.generate(_request_of(result.state))]
    np.testing.assert_array_equal(result.state.token_ids, chunk.token_ids)
    assert result.state == await store.replay("o")
    assert await leases.expiry("o") is None  # dropped at the end, as before


async def test_a_refused_begin_aborts_the_request_and_saves_none_of_its_tokens(
    real_redis: aredis.Redis,
) -> None:
    store = EventStore(real_redis)
    await store.append(None, f.submitted("r", max_tokens=4096))
    engine = SyntheticEngine(tokens_per_chunk=1)
    runner = _runner(store, engine)

    async def another_worker_opens_first(state: RolloutState) -> None:
        await _until_steps(runner, 20)
        await store.append(state, f.started(state, worker="other"))

    _hold_begin(runner, another_worker_opens_first)
    result = await runner.run("r")

    assert result.outcome is Outcome.LOST
    events = await store.events("r")
    assert [type(e).__name__ for e in events] == ["Submitted", "Started"]
    assert events[1].worker_id == "other"
    # The engine request was aborted: the engine holds nothing, its steps end.
    assert engine._ids == []
    assert runner.stepper is not None and runner.stepper._tracks == {}


async def test_an_opening_that_fails_ends_the_run_with_its_error(
    real_redis: aredis.Redis,
) -> None:
    """Redis gone for the begin (here: the lease script raising) fails the run as before, with
    the engine request aborted and nothing saved."""
    store, leases = EventStore(real_redis), Leases(real_redis, holder="w")
    await store.append(None, f.submitted("x", max_tokens=4096))
    engine = SyntheticEngine(tokens_per_chunk=1)
    runner = _runner(store, engine, leases)

    async def lease_fails(rollout_ids: list[str], ttl_s: float) -> list[None]:
        await _until_steps(runner, 5)
        raise ConnectionError("redis went away")

    leases.take_many = lease_fails  # type: ignore[method-assign]
    try:
        await runner.run("x")
    except ConnectionError:
        pass
    else:
        raise AssertionError("the run should raise the opening's error")
    assert [type(e).__name__ for e in await store.events("x")] == ["Submitted"]
    assert engine._ids == []


def _request_of(state: RolloutState):  # type: ignore[no-untyped-def]
    from workers.engines.base import EngineRequest

    request = state.request
    return EngineRequest(
        request_id="ref", prompt_token_ids=request.prompt_token_ids, sampling=request.sampling
    )
