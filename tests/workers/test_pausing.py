"""The deployment's pause as a worker follows it (``workers.pausing``), fast, on fakeredis: the
flag read back with the stats beat, a second /pause keeping its start, abort stopping every
running rollout with its own reason, resume reopening admission, the gauge. The pause with real
worker processes and a real redis-server: ``test_pause.py``."""

from __future__ import annotations

import asyncio

import msgpack
import redis.asyncio as aredis
from prometheus_client import generate_latest

from statemachine import AbortReason
from store.keys import Keys
from store.pause import Pause, PauseFlag
from store.stats import WorkerBeat, beat
from workers.engines.synthetic import SyntheticEngine
from workers.pausing import DeploymentPause
from workers.worker import Worker, WorkerConfig


class Runner:
    """A runner's ``active`` and ``stop``, recorded."""

    def __init__(self, active: list[str]) -> None:
        self.active = active
        self.stopped: list[tuple[str, AbortReason, str]] = []

    async def stop(self, rollout_id: str, reason: AbortReason, detail: str = "") -> None:
        self.stopped.append((rollout_id, reason, detail))


async def test_the_beat_brings_the_pause_back_and_a_second_pause_keeps_its_start(
    fake_redis: aredis.Redis,
) -> None:
    keys, flag = Keys(), PauseFlag(fake_redis)
    me = WorkerBeat("w", 0, 0, ("rollouts",), "m")
    assert await beat(fake_redis, keys, me) is None
    first = await flag.pause("keep")
    assert await beat(fake_redis, keys, me) == first
    again = await flag.pause("abort")  # SkyRL calls every API; or the mode changes
    assert again == Pause("abort", first.at)
    assert await beat(fake_redis, keys, me) == again
    await flag.resume()
    assert await beat(fake_redis, keys, me) is None
    # A worker older than the pause beats five fields: it holds no pause.
    old = msgpack.packb([1, 0, ["rollouts"], "m", 5.0])
    assert WorkerBeat.decode("old", old) == WorkerBeat("old", 1, 0, ("rollouts",), "m", 5.0)
    held = WorkerBeat("w", 0, 0, ("rollouts",), "m", 5.0, paused=first.at)
    assert WorkerBeat.decode("w", held.encode()) == held


async def test_keep_stops_nothing_abort_stops_everything_resume_reopens() -> None:
    pause, runner = DeploymentPause("w"), Runner(["a", "b"])
    stop = asyncio.Event()
    assert await pause.wait_admitting(stop)
    pause.follow(Pause("keep", 1.0), runner)
    assert pause.holds and pause.since == 1.0 and not pause.admitting.is_set()
    await asyncio.sleep(0)
    assert runner.stopped == []  # keep: running rollouts go on
    waiter = asyncio.create_task(pause.wait_admitting(stop))
    pause.follow(Pause("abort", 1.0), runner)  # the same pause, now abort
    await asyncio.sleep(0.01)
    assert [(rid, reason) for rid, reason, _ in runner.stopped] == [
        ("a", AbortReason.PAUSED),
        ("b", AbortReason.PAUSED),
    ]
    assert "mode=abort" in runner.stopped[0][2] and pause.aborted == 2
    pause.follow(Pause("abort", 1.0), runner)  # read again on the next beat: nothing new
    await asyncio.sleep(0.01)
    assert len(runner.stopped) == 2 and not waiter.done()
    pause.follow(None, runner)
    assert await asyncio.wait_for(waiter, 1) is True and not pause.holds
    # A stop request ends the wait of a paused worker (False: it takes no job).
    pause.follow(Pause("wait", 2.0), runner)
    stop.set()
    assert await pause.wait_admitting(stop) is False


def test_the_gauge_says_paused_by_mode() -> None:
    worker = Worker(WorkerConfig(redis_url="redis://unused"), SyntheticEngine())
    worker.pause.follow(Pause("keep", 1.0), Runner([]))
    page = generate_latest(worker.metrics.registry).decode()
    assert 'rollouts_worker_paused{mode="keep"} 1.0' in page
    assert 'rollouts_worker_paused{mode="abort"} 0.0' in page
