"""`rollouts env --tools examples.calculator:calculator` as real processes against a real
redis-server: a SIGTERM lets the running call finish and record its result, then exit 0; a
runner SIGKILLed mid-call (its effect done, no result recorded) is swept by a second runner
once its 1 s lease lapses, and the tool's declared effect decides what ran twice (the
calculator's own log of its executions says)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import redis
import redis.asyncio as aredis

from examples.calculator import LOG_ENV, SLEEP_ENV, observation
from statemachine.episode import ToolEffect
from statemachine.episode_events import ToolCallLost
from statemachine.status import FailureClass, Status
from store import EventStore
from store.environment import EnvironmentClient
from store.redis_server import RedisServer
from tests.workers.env_helpers import TURN, awaiting_call, second_turn
from tests.workers.helpers import stop, until
from workers.env.cli import command

pytestmark = pytest.mark.redis_server

ROOT = Path(__file__).resolve().parents[2]
LEASE_S = "1"


@pytest.fixture
async def env(server: RedisServer) -> AsyncIterator[EnvironmentClient]:
    client = aredis.Redis.from_url(server.url)
    sync = redis.Redis.from_url(server.url)
    yield EnvironmentClient(EventStore(client), sync)
    await client.aclose()
    sync.close()


def start_runner(url: str, out: Path, name: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """A runner process started from the repository's root, as an operator would: its
    summary line on ``out``.stdout, its log on ``out``.log."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    full = {**os.environ, "PYTHONPATH": path, **env}
    cmd = command(url, "--lease-s", LEASE_S, "--runner-id", name)
    with out.with_suffix(".stdout").open("wb") as stdout, out.with_suffix(".log").open("wb") as log:
        return subprocess.Popen(cmd, cwd=ROOT, env=full, stdout=stdout, stderr=log)


def lines(path: Path) -> list[list[str]]:
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


async def logged(path: Path, n: int) -> None:
    async def enough() -> bool:
        return len(lines(path)) >= n

    await until(enough, 30, f"the calculator did not run {n} time(s)")


def status_is(env: EnvironmentClient, status: Status) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return (await env.store.head("ep")).status is status

    return check


async def test_sigterm_lets_the_running_call_record_its_result_then_exits_0(
    env: EnvironmentClient, server: RedisServer, tmp_path: Path
) -> None:
    log = tmp_path / "calls.log"
    await awaiting_call(env.store)
    runner = start_runner(server.url, tmp_path / "r", "r", {LOG_ENV: str(log), SLEEP_ENV: "1"})
    try:
        await logged(log, 1)  # the call is running: its effect is done, it sleeps
        runner.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(runner.wait, 30) == 0
    finally:
        stop(runner)
    state = await env.store.load("ep")
    assert state.status is Status.NEXT_TURN
    result = state.calls[0].result
    assert result is not None and result.observation_token_ids.tolist() == observation(TURN)
    assert result.env_revision == "rev-1" and result.seconds >= 1.0
    summary = json.loads((tmp_path / "r.stdout").read_text())
    assert (summary["runner"], summary["results"], summary["abandoned"]) == ("r", 1, 0)
    assert [line[:2] for line in lines(log)] == [["ep/c1", "False"]]


@pytest.mark.parametrize("effect", list(ToolEffect))
async def test_a_runner_killed_mid_call_is_swept_and_the_declared_effect_decides(
    env: EnvironmentClient, server: RedisServer, tmp_path: Path, effect: ToolEffect
) -> None:
    log = tmp_path / "calls.log"
    await awaiting_call(env.store, effect=effect)
    await second_turn(env, revision="rev-1")  # call c1's result recorded; c2 pending
    a = start_runner(server.url, tmp_path / "a", "a", {LOG_ENV: str(log), SLEEP_ENV: "60"})
    b = None
    try:
        await logged(log, 1)  # runner a ran c2's effect and holds it, sleeping
        b = start_runner(server.url, tmp_path / "b", "b", {LOG_ENV: str(log)})
        a.kill()
        a.wait(10)
        ended = Status.FAILED if effect is ToolEffect.RESTART else Status.NEXT_TURN
        await until(status_is(env, ended), 60, f"the episode did not reach {ended.value}")
    finally:
        stop(a, *([b] if b else []))
    state = await env.store.load("ep")
    [lost] = [e for e in await env.store.events("ep") if isinstance(e, ToolCallLost)]
    assert lost.call_id == "c2" and lost.decision is effect
    assert state.calls[1].claims[0].runner_id == "a"
    runs = lines(log)
    assert [(key, rev) for key, _, _, rev in runs] == [("ep/c2", "rev-1")] * len(runs)
    assert runs[0][2] == str(a.pid)
    if effect is ToolEffect.RESTART:
        # Not run again: the episode fails, saying the effect is unverified.
        assert state.failure is FailureClass.EFFECT_UNVERIFIED and len(runs) == 1
        return
    # Run again by runner b: a restore tool told to go back to rev-1 first.
    assert b is not None and len(runs) == 2 and runs[1][2] == str(b.pid)
    assert runs[1][1] == str(effect is ToolEffect.RESTORE)
    result = state.calls[1].result
    assert result is not None and result.env_revision == "rev-2"
    assert result.observation_token_ids.tolist() == observation((51, 52, 7))
    assert state.calls[1].claims[-1].runner_id == "b"
