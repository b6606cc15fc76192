"""The wall-time sweep, on fakeredis and a real redis-server: an episode whose tool call waits
on its queue past ``max_wall_seconds`` with no runner claiming it ends ``wall_time``; one still
within its budget, one claimed, one without the budget and a plain rollout are left alone; the
deadline index follows the call on and off its queue, as the queue itself does."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from statemachine.status import FinishReason, Status
from store.environment import EnvironmentClient
from store.tool_sweep import sweep_lost_calls, sweep_wall_time
from tests import factories as f


@pytest.fixture
def t0() -> float:
    """The submitter's clock when it submitted: now, since a claim checks the budget by the
    runner's own clock; the sweeps below are handed later times."""
    return float(int(time.time()))


async def _waiting(env: EnvironmentClient, t0: float, rid: str = "ep", **kw: Any) -> None:
    """An episode submitted at ``t0`` whose first turn ended at a call."""
    store = env.store
    s = await store.append(None, replace(f.episode_submitted(rid, **kw), at=t0))
    s = await store.append(s, f.started(s))
    s = await store.append(s, f.tokens(s, n=3))
    await store.append(s, f.requested(s, "calc"))


async def _deadlines(env: EnvironmentClient) -> dict[bytes, float]:
    key = env.store.keys.episode_deadlines()
    return dict(await env.store.redis.zrange(key, 0, -1, withscores=True))


def _at(t: float) -> Any:
    return lambda: t


async def test_a_call_nobody_claims_in_time_ends_the_episode_wall_time(
    env: EnvironmentClient, t0: float
) -> None:
    await _waiting(env, t0, "ep", max_wall_seconds=10.0)
    await _waiting(env, t0, "other", max_wall_seconds=60.0)
    await _waiting(env, t0, "unbounded")
    assert await _deadlines(env) == {b"ep": 1000 * (t0 + 10), b"other": 1000 * (t0 + 60)}
    assert await sweep_wall_time(env.store, clock=_at(t0 + 9.9)) == []  # within its budget
    assert await sweep_wall_time(env.store, clock=_at(t0 + 10)) == ["ep"]
    state = await env.store.head("ep")
    assert state.status is Status.DONE and state.finish_reason is FinishReason.WALL_TIME
    assert len(state.calls) == 1 and state.calls[0].result is None  # the call never ran
    # Off its queue and the deadline index with the append that ended it; nothing to claim.
    queued = await env.store.redis.zrange(env.store.keys.env_queue("default"), 0, -1)
    assert sorted(queued) == [b"other", b"unbounded"]
    assert await _deadlines(env) == {b"other": 1000 * (t0 + 60)}
    assert await sweep_wall_time(env.store, clock=_at(t0 + 10)) == []  # done once


async def test_a_claimed_call_leaves_the_index_and_a_lost_one_comes_back(
    env: EnvironmentClient, t0: float
) -> None:
    await _waiting(env, t0, max_wall_seconds=10.0)
    claim = await env.claim("default", "r1", lease_s=0.05)
    assert claim is not None
    assert await _deadlines(env) == {}  # running: the runner's result decides, not the sweep
    await asyncio.sleep(0.15)
    assert await sweep_lost_calls(env.store) == ["ep"]  # its runner is lost: claimable again
    assert await _deadlines(env) == {b"ep": 1000 * (t0 + 10)}
    assert await sweep_wall_time(env.store, clock=_at(t0 + 11)) == ["ep"]
    assert (await env.store.head("ep")).finish_reason is FinishReason.WALL_TIME


async def test_a_result_and_the_next_turn_take_the_episode_off_the_index(
    env: EnvironmentClient, t0: float
) -> None:
    await _waiting(env, t0, max_wall_seconds=1e9)
    claim = await env.claim("default", "r1")
    assert claim is not None
    await env.record_result(claim, np.array([5, 6], dtype=np.int32))
    assert (await env.store.head("ep")).status is Status.NEXT_TURN
    assert await _deadlines(env) == {}


async def test_an_entry_whose_episode_is_gone_is_dropped(env: EnvironmentClient, t0: float) -> None:
    await _waiting(env, t0, max_wall_seconds=10.0)
    keys = env.store.keys
    await env.store.redis.delete(keys.log("ep"), keys.snapshot("ep"))
    assert await sweep_wall_time(env.store, clock=_at(t0 + 11)) == []
    assert await _deadlines(env) == {}
