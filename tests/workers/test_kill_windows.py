"""A worker killed at any step between taking a job and its rollout's first event, or between
an abort and giving the job back, strands nothing: another worker's reaper gives the job
back (rq's abandoned executions and stuck dequeues) and the rollout ends."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis.asyncio as aredis

from statemachine import Status
from store import EventStore
from store.client import RolloutClient
from store.redis_server import RedisServer
from tests import factories as f
from workers.engines.synthetic import SyntheticEngine
from workers.worker import Worker, WorkerConfig

pytestmark = pytest.mark.redis_server


@pytest.mark.parametrize("step", ["dequeued", "started", "leased", "aborted"])
async def test_a_kill_between_taking_a_job_and_its_first_event_strands_nothing(
    server: RedisServer, tmp_path: Path, step: str
) -> None:
    client = RolloutClient(server.url)
    # The poison token makes the first attempt end in an engine error ("aborted" step); the
    # healthy worker below has no poison and finishes it.
    prompt = (1, 7, 2) if step == "aborted" else (1, 2, 3)
    [rid] = await client.submit([f.request(16, prompt=prompt)])
    log = tmp_path / "dying.log"
    dying = subprocess.Popen(
        [sys.executable, "-m", "tests.workers.dying_worker", server.url, step],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    assert dying.wait(60) == -9, log.read_text()
    store = EventStore(aredis.Redis.from_url(server.url))
    # Before: the rollout stayed pending (or aborted) with no lease and no live job, forever.
    possible = {Status.PENDING, Status.ABORTED}
    if step == "started":
        # The worker runs a job's rollout while rq's start is sent (dequeue_many's
        # await_start=False): the kill once rq has it may come before the lease, after the
        # attempt began or, on a loaded machine, after its 16 tokens were done.
        possible |= {Status.GENERATING, Status.DONE}
    if step == "leased":
        # Its lease and its attempt, taken in one transaction: generating, leased, nobody on
        # it (the lease lapses and a reaper takes it over).
        possible = {Status.GENERATING}
    assert (await store.load(rid)).status in possible
    healthy = Worker(
        WorkerConfig(
            redis_url=server.url, reap_interval_s=0.2, name="healthy", rq_execution_ttl_s=2.0
        ),
        SyntheticEngine(),
    )
    task = asyncio.create_task(healthy.run())
    t0 = time.monotonic()
    try:
        [result] = await client.wait([rid], timeout=30)
    finally:
        healthy.request_stop()
        await asyncio.wait_for(task, 30)
    assert result.status is Status.DONE and len(result.response_token_ids) == 16
    assert time.monotonic() - t0 < 15  # rq's own detection takes 60-90 s and more
    await client.aclose()
