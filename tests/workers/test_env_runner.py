"""The environment runner in-process, on a real redis-server: results and failures recorded
through the fenced store, a fenced-out runner writing nothing, several runners sweeping one
lost call, calls at once, and a stop that waits for running calls within its grace."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
import redis.asyncio as aredis

from examples.calculator import LOG_ENV, calculator, observation
from statemachine.episode import ToolEffect
from statemachine.episode_events import ToolCallLost
from statemachine.status import FailureClass, Status, ToolFailure
from store import EventStore
from store.environment import EnvironmentClient
from store.lifecycle import cancel
from store.redis_server import RedisServer
from store.tool_sweep import sweep_lost_calls
from tests.workers.env_helpers import TURN, awaiting_call
from tests.workers.helpers import until
from workers.env import Call, ToolFatal, ToolOutput
from workers.env.runner import EnvRunner, RunnerConfig, RunnerStats

pytestmark = pytest.mark.redis_server


@pytest.fixture
async def env(redis_server: RedisServer) -> AsyncIterator[EnvironmentClient]:
    client = aredis.Redis.from_url(redis_server.url)
    sync = redis.Redis.from_url(redis_server.url)
    await client.flushall()
    yield EnvironmentClient(EventStore(client), sync, retries=1)
    await client.aclose()
    sync.close()


@asynccontextmanager
async def serving(
    env: EnvironmentClient, tools: dict[str, Any], runner_id: str = "r1", **config: Any
) -> AsyncIterator[EnvRunner]:
    runner = EnvRunner(env, tools, RunnerConfig(runner_id=runner_id, **config))
    task = asyncio.create_task(runner.run())
    try:
        yield runner
    finally:
        runner.request_stop()
        assert isinstance(await asyncio.wait_for(task, 10), RunnerStats)


def status_is(env: EnvironmentClient, *statuses: Status, rid: str = "ep") -> Callable[[], Any]:
    async def check() -> bool:
        return (await env.store.head(rid)).status in statuses

    return check


async def test_a_pending_call_gets_the_calculators_result(
    env: EnvironmentClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(LOG_ENV, str(tmp_path / "calls.log"))
    await awaiting_call(env.store)
    async with serving(env, {"calculator": calculator}) as runner:
        await until(status_is(env, Status.NEXT_TURN), 10, "no result recorded")
    state = await env.store.load("ep")
    [call] = state.calls
    assert call.result is not None
    assert call.result.observation_token_ids.tolist() == observation(TURN)
    assert all(3 <= t <= 99 for t in observation(TURN))
    assert (call.result.env_handle, call.result.env_revision) == ("calculator", "rev-1")
    assert call.claims[0].runner_id == "r1" and 0 < call.seconds < 5
    assert runner.stats.results == 1 and runner.stats.by_tool == {"calculator": 1}
    assert (tmp_path / "calls.log").read_text() == f"ep/c1 False {os.getpid()} -\n"


async def test_a_raising_tool_is_retried_then_fails_the_episode_env_error(
    env: EnvironmentClient,
) -> None:
    runs = []

    def flaky(call: Call) -> list[int]:
        runs.append(call.idempotency_key)
        raise RuntimeError(f"sandbox down ({len(runs)})")

    await awaiting_call(env.store, tool="flaky")
    async with serving(env, {"flaky": flaky}) as runner:  # the client retries once
        await until(status_is(env, Status.FAILED), 10, "the episode did not fail")
    state = await env.store.load("ep")
    assert state.failure is FailureClass.ENV_ERROR and runs == ["ep/c1", "ep/c1"]
    claims = state.calls[0].claims
    assert [c.failure for c in claims] == [ToolFailure.ENV_ERROR] * 2
    assert [c.error for c in claims] == ["RuntimeError: sandbox down (1)",
                                         "RuntimeError: sandbox down (2)"]  # fmt: skip
    assert runner.stats.env_errors == 2


async def _fatal(call: Call) -> list[int]:
    raise ToolFatal("no such file in the task")


@pytest.mark.parametrize(
    ("tool", "served", "arguments", "error"),
    [
        ("fatal", _fatal, None, "no such file in the task"),
        ("calculator", calculator, '{"x": 1}', 'calculator wants {"token_ids"'),
        ("calculator", calculator, "not json", "arguments of 'calculator' are not JSON"),
        ("nope", calculator, None, "tool 'nope' is not served by runner r1"),
        ("neg", lambda call: [5, -1], None, "returned an invalid result"),
        ("text", lambda call: "42", None, "tool 'text' returned str"),
    ],
)
async def test_a_call_that_cannot_succeed_fails_the_episode_env_fatal_at_once(
    env: EnvironmentClient, tool: str, served: Any, arguments: str | None, error: str
) -> None:
    # An unknown tool: the runner serves "calculator" under that name, the call names "nope".
    name = "calculator" if tool == "nope" else tool
    await awaiting_call(env.store, tool=tool, arguments=arguments)
    async with serving(env, {name: served}) as runner:
        await until(status_is(env, Status.FAILED), 10, "the episode did not fail")
    state = await env.store.load("ep")
    [claim] = state.calls[0].claims
    assert state.failure is FailureClass.ENV_FATAL and claim.failure is ToolFailure.ENV_FATAL
    assert error in claim.error, claim.error
    assert runner.stats.env_fatals == 1


async def test_a_late_result_of_a_claim_taken_over_is_refused_and_writes_nothing(
    env: EnvironmentClient,
) -> None:
    release = asyncio.Event()

    async def slow(call: Call) -> ToolOutput:
        await release.wait()
        return ToolOutput([10], env_revision="late")

    await awaiting_call(env.store, tool="slow")
    # No heartbeat and no sweep of its own: its lease lapses while the tool runs.
    async with serving(env, {"slow": slow}, lease_s=0.2, heartbeat_s=60, sweep_s=60) as runner:
        await until(status_is(env, Status.RUNNING_TOOL), 10, "not claimed")
        await asyncio.sleep(0.3)
        assert await sweep_lost_calls(env.store) == ["ep"]
        other = await env.claim("default", "r2")
        assert other is not None and other.claim == 2
        seq = (await env.store.head("ep")).seq
        release.set()
        await until(lambda: _true(runner.stats.fenced == 1), 10, "not refused")
        assert (await env.store.head("ep")).seq == seq  # nothing written
        assert runner.stats.results == 0
    after = await env.record_result(other, np.array([11], dtype=np.int32))
    assert after.status is Status.NEXT_TURN


async def test_a_heartbeat_finding_its_claim_ended_cancels_the_tool(
    env: EnvironmentClient,
) -> None:
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def endless(call: Call) -> list[int]:
        started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return [10]

    await awaiting_call(env.store, tool="endless")
    async with serving(env, {"endless": endless}, lease_s=1.0, heartbeat_s=0.05) as runner:
        await asyncio.wait_for(started.wait(), 10)
        assert await cancel(env.store, ["ep"], "trainer", refuse_ended=True) == ["ep"]
        await asyncio.wait_for(cancelled.wait(), 10)
        await until(lambda: _true(runner.stats.fenced == 1), 10, "not counted")
    state = await env.store.head("ep")
    assert state.status is Status.CANCELLED
    assert runner.stats.env_errors == runner.stats.results == 0


async def test_runners_sweeping_at_once_record_a_lost_call_once_and_rerun_it_once(
    env: EnvironmentClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "calls.log"
    monkeypatch.setenv(LOG_ENV, str(log))
    await awaiting_call(env.store, effect=ToolEffect.IDEMPOTENT)
    dead = await env.claim("default", "dead-runner", lease_s=0.1)  # never reports
    assert dead is not None
    tools = {"calculator": calculator}
    async with (
        serving(env, tools, "a", sweep_s=0.02) as a,
        serving(env, tools, "b", sweep_s=0.02) as b,
    ):
        await until(status_is(env, Status.NEXT_TURN), 10, "not rerun")
    events = await env.store.events("ep")
    assert sum(isinstance(e, ToolCallLost) for e in events) == 1
    assert a.stats.swept + b.stats.swept == 1
    assert a.stats.results + b.stats.results == 1
    assert len(log.read_text().splitlines()) == 1  # the dead claim ran nothing here


async def test_calls_run_at_once_up_to_the_concurrency(env: EnvironmentClient) -> None:
    both = asyncio.Barrier(2)

    async def meet(call: Call) -> list[int]:
        await asyncio.wait_for(both.wait(), 5)  # only if both calls run at once
        return [10]

    for rid in ("e1", "e2"):
        await awaiting_call(env.store, rid, tool="meet")
    async with serving(env, {"meet": meet}, concurrency=2) as runner:
        for rid in ("e1", "e2"):
            await until(status_is(env, Status.NEXT_TURN, rid=rid), 10, f"{rid} not served")
    assert runner.stats.results == 2


async def test_a_stop_lets_a_running_call_finish_within_the_grace(
    env: EnvironmentClient,
) -> None:
    started = asyncio.Event()

    async def brief(call: Call) -> list[int]:
        started.set()
        await asyncio.sleep(0.3)
        return [10]

    await awaiting_call(env.store, tool="brief")
    async with serving(env, {"brief": brief}) as runner:
        await asyncio.wait_for(started.wait(), 10)
        runner.request_stop()  # the context's own stop then waits for run() to return
    assert (await env.store.head("ep")).status is Status.NEXT_TURN
    assert runner.stats.results == 1 and runner.stats.abandoned == 0


async def test_a_call_still_running_after_the_grace_is_left_to_its_lease(
    env: EnvironmentClient,
) -> None:
    started, release = threading.Event(), threading.Event()

    def stuck(call: Call) -> list[int]:  # a sync tool: its thread cannot be stopped
        started.set()
        release.wait(5)
        return [10]

    await awaiting_call(env.store, tool="stuck")
    async with serving(env, {"stuck": stuck}, grace_s=0.1) as runner:
        await until(lambda: _true(started.is_set()), 10, "not started")
    state = await env.store.head("ep")
    # Nothing reported: its effect is unverified, the sweep decides once the lease lapses.
    assert state.status is Status.RUNNING_TOOL and runner.stats.abandoned == 1
    release.set()


async def _true(value: bool) -> bool:
    return value
