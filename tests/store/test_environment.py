"""EnvironmentClient and the lost-call sweep, on fakeredis and a real redis-server: claims
fenced and leased, results that make the next turn runnable, failures within and beyond their
retries, a zombie runner refused, and lost runners decided by each tool's declared effect."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from statemachine import RolloutState
from statemachine.episode import ToolEffect
from statemachine.episode_events import ToolCallLost
from statemachine.status import FailureClass, FinishReason, Status, ToolFailure
from store.environment import EnvironmentClient
from store.errors import ClaimLost
from store.queue import rollout_queue
from store.tool_sweep import sweep_lost_calls
from tests import factories as f
from tests.store.conftest import leased as _leased
from tests.store.conftest import queued as _queued
from tests.store.conftest import waiting as _waiting


async def test_a_requested_call_is_claimed_once_leased_and_off_its_queue(
    env: EnvironmentClient,
) -> None:
    await _waiting(env, tool="calc", env_queue="box")
    assert await _queued(env, "box") == [b"ep"]
    assert await env.claim("default", "r0") is None  # another queue's call
    a, b = await asyncio.gather(env.claim("box", "r1"), env.claim("box", "r2"))
    got = [c for c in (a, b) if c is not None]
    assert len(got) == 1  # exactly one runner gets it
    claim = got[0]
    assert (claim.rollout_id, claim.call_id, claim.claim, claim.name) == ("ep", "c1", 1, "calc")
    assert claim.effect is ToolEffect.IDEMPOTENT and claim.idempotency_key == "ep/c1"
    assert (claim.env_revision, claim.restore) == ("", False)
    assert await _queued(env, "box") == [] and await _leased(env) == [b"ep"]
    assert (await env.store.head("ep")).status is Status.RUNNING_TOOL
    assert await env.heartbeat([claim]) == [True]


async def test_a_blocking_claim_waits_for_a_call(env: EnvironmentClient) -> None:
    waiter = asyncio.create_task(env.claim("default", "r1", timeout_s=5.0))
    await asyncio.sleep(0.1)
    assert not waiter.done()
    await _waiting(env)
    claim = await asyncio.wait_for(waiter, 5.0)
    assert claim is not None and claim.call_id == "c1"
    assert await env.claim("default", "r1", timeout_s=0.1) is None  # times out empty


async def test_a_result_makes_the_next_turn_runnable_and_a_zombie_is_refused(
    env: EnvironmentClient,
) -> None:
    await _waiting(env)
    claim = await env.claim("default", "r1")
    assert claim is not None
    obs = np.array([900, 901], dtype=np.int32)
    after = await env.record_result(claim, obs, env_handle="h", env_revision="v1", seconds=0.2)
    assert after.status is Status.NEXT_TURN and await _leased(env) == []
    loaded = await env.store.load("ep")
    assert loaded.calls[0].result is not None and loaded.calls[0].result.env_revision == "v1"
    # Its next turn's generation job is on the rollout's rq queue, listed for its ack.
    queue = rollout_queue(env.connection, loaded.queue)
    [job_id] = queue.get_job_ids()
    job = queue.fetch_job(job_id)
    assert job is not None and job.kwargs == {"rollout_id": "ep"}
    assert job_id.encode() in (await env.store.redis.hget(env.store.keys.snapshot("ep"), "job"))
    # The same runner reporting again, or reporting a failure now: refused, nothing written.
    seq = loaded.seq
    with pytest.raises(ClaimLost):
        await env.record_result(claim, obs)
    with pytest.raises(ClaimLost):
        await env.record_failure(claim, ToolFailure.ENV_ERROR, "late")
    assert (await env.store.head("ep")).seq == seq and len(queue.get_job_ids()) == 1
    assert await env.heartbeat([claim]) == [False]


async def test_a_result_that_spends_a_budget_ends_the_episode_with_no_job(
    env: EnvironmentClient,
) -> None:
    await _waiting(env, max_total_tokens=4)  # 3 sampled tokens so far
    claim = await env.claim("default", "r1")
    assert claim is not None
    after = await env.record_result(claim, np.array([5], dtype=np.int32))
    assert after.status is Status.DONE and after.finish_reason is FinishReason.MAX_TOTAL_TOKENS
    assert rollout_queue(env.connection, after.queue).get_job_ids() == []
    assert await _leased(env) == []


async def test_a_call_whose_budget_is_spent_is_not_claimed_and_its_episode_ends(
    env: EnvironmentClient,
) -> None:
    # Written without request_call's own check: a call only a turn past max_turns could use.
    await _waiting(env, max_turns=1)
    assert await env.claim("default", "r1") is None
    state = await env.store.head("ep")
    assert state.status is Status.DONE and state.finish_reason is FinishReason.MAX_TURNS
    assert await _queued(env) == []


async def test_env_errors_are_retried_within_the_budget_then_fail_the_episode(
    env: EnvironmentClient,
) -> None:
    await _waiting(env)
    first = await env.claim("default", "r1")
    assert first is not None
    after = await env.record_failure(first, ToolFailure.ENV_ERROR, "flaky", seconds=0.1)
    assert after.status is Status.AWAITING_TOOL and await _queued(env) == [b"ep"]
    second = await env.claim("default", "r2")
    assert second is not None and second.claim == 2
    after = await env.record_failure(second, ToolFailure.ENV_ERROR, "flaky again")
    assert after.status is Status.FAILED and after.failure is FailureClass.ENV_ERROR
    assert await _queued(env) == [] and await _leased(env) == []
    await _completed(env, "ep", b"failed")


async def test_env_fatal_fails_the_episode_at_once(env: EnvironmentClient) -> None:
    await _waiting(env)
    claim = await env.claim("default", "r1")
    assert claim is not None
    after = await env.record_failure(claim, ToolFailure.ENV_FATAL, "bad arguments")
    assert after.status is Status.FAILED and after.failure is FailureClass.ENV_FATAL
    await _completed(env, "ep", b"failed")


async def _completed(env: EnvironmentClient, rid: str, status: bytes) -> None:
    entries = await env.store.redis.xrange(env.store.keys.completions(""))
    assert [(e[b"r"], e[b"s"]) for _, e in entries] == [(rid.encode(), status)]


async def _lose_runner(env: EnvironmentClient, tool: str) -> tuple[Any, RolloutState]:
    """An episode whose call of ``tool`` (after a first result) is claimed with a short lease
    that lapses: the sweep's input."""
    await _waiting(env, tool="calc")
    first = await env.claim("default", "r0")
    assert first is not None
    await env.record_result(first, np.array([7], dtype=np.int32), env_handle="h", env_revision="v1")
    s = await env.store.head("ep")
    s = await env.store.append(s, f.resumed(s))
    s = await env.store.append(s, f.tokens(s, n=2))
    await env.store.append(s, f.requested(s, tool))
    claim = await env.claim("default", "r1", lease_s=0.05)
    assert claim is not None and claim.claim == 1
    await asyncio.sleep(0.15)
    return claim, await env.store.head("ep")


@pytest.mark.parametrize("tool", ["calc", "edit"])
async def test_a_lost_runner_of_a_rerunnable_tool_makes_its_call_claimable_again(
    env: EnvironmentClient, tool: str
) -> None:
    zombie, _ = await _lose_runner(env, tool)
    # Two sweepers at once: exactly one records the loss.
    a, b = await asyncio.gather(sweep_lost_calls(env.store), sweep_lost_calls(env.store))
    assert sorted(a + b) == ["ep"]
    events = await env.store.events("ep")
    assert sum(isinstance(e, ToolCallLost) for e in events) == 1
    assert await _queued(env) == [b"ep"] and await _leased(env) == []
    again = await env.claim("default", "r2")
    assert again is not None and again.claim == 2 and again.env_revision == "v1"
    assert again.restore is (tool == "edit")  # a restore tool goes back to v1 first
    with pytest.raises(ClaimLost):  # the lost runner's late result
        await env.record_result(zombie, np.array([1], dtype=np.int32))
    assert await env.heartbeat([zombie, again]) == [False, True]
    assert await sweep_lost_calls(env.store) == []  # the new claim's lease is live


async def test_a_lost_runner_of_a_restart_tool_fails_the_episode_unverified(
    env: EnvironmentClient,
) -> None:
    await _lose_runner(env, "send")
    assert await sweep_lost_calls(env.store) == ["ep"]
    state = await env.store.head("ep")
    assert state.status is Status.FAILED and state.failure is FailureClass.EFFECT_UNVERIFIED
    assert await _queued(env) == [] and await _leased(env) == []
    await _completed(env, "ep", b"failed")


async def test_a_renewed_claim_is_not_swept(env: EnvironmentClient) -> None:
    await _waiting(env)
    claim = await env.claim("default", "r1", lease_s=0.2)
    assert claim is not None
    for _ in range(3):
        await asyncio.sleep(0.1)
        assert await env.heartbeat([claim], lease_s=0.2) == [True]
    assert await sweep_lost_calls(env.store) == []
    assert (await env.store.head("ep")).status is Status.RUNNING_TOOL


async def test_a_heartbeat_under_an_earlier_calls_claim_number_is_not_live(
    env: EnvironmentClient,
) -> None:
    # Claim numbers count per call: the next call's first claim is number 1 again, so the
    # fence a heartbeat names is the call and the claim, not the number alone.
    await _waiting(env)
    first = await env.claim("default", "r0")
    assert first is not None
    await env.record_result(first, np.array([7], dtype=np.int32))
    s = await env.store.head("ep")
    s = await env.store.append(s, f.resumed(s))
    s = await env.store.append(s, f.tokens(s, n=2))
    await env.store.append(s, f.requested(s, "calc"))
    second = await env.claim("default", "r1", lease_s=0.3)
    assert second is not None and (second.call_id, second.claim) == ("c2", first.claim)
    assert await env.heartbeat([first, second], lease_s=0.3) == [False, True]
    # The first call's zombie renews nothing: the second's lease lapses on its own.
    await asyncio.sleep(0.2)
    assert await env.heartbeat([first], lease_s=5.0) == [False]
    await asyncio.sleep(0.2)
    assert await sweep_lost_calls(env.store) == ["ep"]
