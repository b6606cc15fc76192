"""The deployment's pause (a harness's ``POST /pause``, recorded by ``store.pause``) reaching
real worker processes on a real redis-server (synthetic engine, paced at 200 tokens/s).

keep: a rollout submitted during the pause stays pending with its job queued while a running
one finishes; after resume it runs. abort: a running rollout is aborted with reason ``paused``,
its progress kept and no budget charged, and after resume it finishes with the greedy tokens of
an uninterrupted run. The flag is one AOF-persisted key: a Redis restart keeps the pause.
``/pause?mode=wait``: tests/api/harness/test_control.py."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import numpy as np
import pytest

from statemachine import Aborted, AbortReason, Resumed, RolloutRequest, Started, Status
from store.client import RolloutClient
from store.pause import Pause, PauseFlag
from store.queue import rollout_queue
from store.redis_server import RedisServer
from store.stats import read_stats
from tests.workers.helpers import (
    SYNTHETIC,
    direct_greedy,
    greedy,
    random_prompts,
    start_worker,
    stop,
    until,
)
from workers.cli import main

pytestmark = pytest.mark.redis_server

FAST = ("--heartbeat", "0.25", "--lease-ttl", "2")


def request(n: int, seed: int) -> RolloutRequest:
    return RolloutRequest(prompt_token_ids=random_prompts(1, seed)[0], sampling=greedy(n))


async def tokens(client: RolloutClient, rid: str) -> int:
    return (await client.store.load(rid)).num_tokens


async def held_by_every_worker(client: RolloutClient, pause: Pause) -> bool:
    """Every live worker's beat says it holds ``pause`` (so it takes no job)."""
    stats = await read_stats(client.redis, client.keys)
    return bool(stats.workers) and all(w.paused == pause.at for w in stats.workers)


def queued(client: RolloutClient) -> int:
    return int(rollout_queue(client._queue.connection, "rollouts").count)


async def test_keep_holds_new_rollouts_queued_while_running_ones_finish(
    server: RedisServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    client = RolloutClient(server.url)
    flag = PauseFlag(client.redis, client.keys)
    # The default heartbeat (1 s): a pause and a resume are seen within about that.
    worker = start_worker(server.url, SYNTHETIC, "w1", tmp_path / "w1.log")
    try:
        [running] = await client.submit([request(600, 0)])  # 3 s at 200 tokens/s
        await until(lambda: tokens(client, running), what="never started")
        paused = await flag.pause("keep")
        await until(lambda: held_by_every_worker(client, paused), 10, "pause not seen")
        assert (await client.store.load(running)).status is Status.GENERATING
        [held] = await client.submit([request(40, 1)])
        done = await client.wait([running], timeout=60)
        assert done[0].status is Status.DONE and len(done[0].response_token_ids) == 600
        await asyncio.sleep(1.0)  # four heartbeats: nothing takes it
        state = await client.store.load(held)
        assert state.status is Status.PENDING and state.attempt == 0
        assert queued(client) == 1
        # `rollouts status` shows the pause and the worker holding it.
        code = await asyncio.to_thread(main, ["status", "--redis", server.url])
        out = capsys.readouterr().out
        assert code == 0 and "admission    PAUSED (mode keep) since" in out, out
        assert "no (paused)" in out
        await asyncio.to_thread(main, ["status", "--redis", server.url, "--json"])
        status = json.loads(capsys.readouterr().out)
        assert status["paused"] == {"mode": "keep", "since": paused.at}
        assert [w["paused"] for w in status["workers"]] == [True]
        await flag.resume()
        resumed = time.monotonic()
        await until(lambda: _taken(client, held), 10, "not taken after /resume")
        assert time.monotonic() - resumed < 2.5  # one heartbeat, a dequeue, an open
        [after] = await client.wait([held], timeout=60)
        assert after.status is Status.DONE and len(after.response_token_ids) == 40
        events = await client.store.events(held)
        assert not any(isinstance(e, Aborted) for e in events)
    finally:
        stop(worker)
        await client.aclose()


async def test_abort_gives_running_rollouts_back_and_they_resume_exactly(
    server: RedisServer, tmp_path: Path
) -> None:
    client = RolloutClient(server.url)
    flag = PauseFlag(client.redis, client.keys)
    worker = start_worker(server.url, SYNTHETIC, "w1", tmp_path / "w1.log", *FAST)
    n = 400
    reqs = [request(n, seed) for seed in (10, 11)]
    try:
        ids = await client.submit(reqs)
        await until(lambda: _all_past(client, ids, 16), what="never started")
        paused = await flag.pause("abort")
        await until(lambda: _all_status(client, ids, Status.ABORTED), 10, "not aborted")
        kept = [await tokens(client, rid) for rid in ids]
        assert all(0 < k < n for k in kept), kept
        await until(lambda: held_by_every_worker(client, paused), 10, "pause not seen")
        await asyncio.sleep(1.0)  # paused: neither is taken again
        for rid, k in zip(ids, kept, strict=True):
            state = await client.store.load(rid)
            assert state.status is Status.ABORTED and state.num_tokens == k
            assert state.abort_reason is AbortReason.PAUSED
        assert queued(client) == 2  # back on the queue, nothing lost
        # The flag is a key in the AOF: a Redis restart keeps the pause.
        server.restart(kill=True)
        await asyncio.sleep(1.0)
        assert await flag.current() == paused
        assert [(await client.store.load(r)).status for r in ids] == [Status.ABORTED] * 2
        await flag.resume()
        results = await client.wait(ids, timeout=120)
    finally:
        stop(worker)
    reference = await direct_greedy(None, SYNTHETIC, [r.prompt_token_ids for r in reqs], greedy(n))
    for rid, result, (ref_ids, ref_lp) in zip(ids, results, reference, strict=True):
        assert result.status is Status.DONE
        np.testing.assert_array_equal(result.response_token_ids, ref_ids)
        np.testing.assert_allclose(result.logprobs, ref_lp, atol=1e-6)
        events = await client.store.events(rid)
        aborts = [e.reason for e in events if isinstance(e, Aborted)]
        # No budget charged: its only abort is the pause's, never an engine error or a lost
        # worker (the two budgets), and it resumed from its saved tokens.
        assert aborts == [AbortReason.PAUSED], aborts
        assert [type(e) for e in events if isinstance(e, Started | Resumed)] == [Started, Resumed]
        assert result.failure is None
    await client.aclose()


async def _all_past(client: RolloutClient, ids: list[str], n: int) -> bool:
    return all([await tokens(client, rid) >= n for rid in ids])


async def _all_status(client: RolloutClient, ids: list[str], status: Status) -> bool:
    return all(s is status for s in await client.store.statuses(ids))


async def _taken(client: RolloutClient, rid: str) -> bool:
    return (await client.store.load(rid)).status is not Status.PENDING
