"""`rollouts requeue --all-waiting` on a real redis-server: the queue lost (every ``rq:*`` key
deleted, what losing the queue's own Redis will mean once it is split from the store), every
rollout waiting for a worker gets one job again from the store alone, and real worker processes
(synthetic engine, resume-exact) finish each exactly once with the tokens of an uninterrupted
run. Rollouts generating on a live worker when the queue goes are left alone and finish; with
no operator at all, a worker's stranded-rollout net (workers/stranded.py) recovers the queue.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from redis import Redis

from statemachine import Aborted, Finished, Resumed, RolloutRequest, Started, Status
from store.client import RolloutClient
from store.event_store import JOB
from store.redis_server import RedisServer
from tests import factories as f
from tests.ops.test_ops_cli import cli, run_cli
from tests.store.trainer import dump
from tests.workers.helpers import (
    SYNTHETIC,
    direct_greedy,
    greedy,
    random_prompts,
    start_worker,
    stop,
    until,
)
from workers.engines.synthetic import SyntheticEngine
from workers.worker import Worker, WorkerConfig

pytestmark = pytest.mark.redis_server

FAST = ("--lease-ttl", "2", "--heartbeat", "0.25")


def _lose_the_queue(conn: Redis) -> int:
    """Delete every rq key (queues, jobs, registries, rq's worker records): the store's keys
    stay, as they would on their own Redis."""
    keys = list(conn.scan_iter(match="rq:*", count=1000))
    assert keys, "no rq key to lose"
    conn.delete(*keys)
    return len(keys)


def _requests(n: int, tokens: int) -> list[RolloutRequest]:
    prompts = random_prompts(n, seed=7, length=5)
    return [RolloutRequest(prompt_token_ids=p, sampling=greedy(tokens)) for p in prompts]


async def _generating(client: RolloutClient, ids: list[str], at_least: int) -> list[str]:
    states = [await client.store.head(rid) for rid in ids]
    return [s.rollout_id for s in states
            if s.status is Status.GENERATING and s.num_tokens >= at_least]  # fmt: skip


async def _check_ran_once(
    client: RolloutClient, reqs: list[RolloutRequest], ids: list[str], aborts: set[str],
    *, timeout: float = 120,
) -> None:  # fmt: skip
    """Each rollout done once, with the tokens an uninterrupted run gives: one start, one
    finish, and a resume only after an abort (the rollouts of ``aborts``, once each)."""
    results = await client.wait(ids, timeout=timeout)
    assert [r.status for r in results] == [Status.DONE] * len(ids)
    want = await direct_greedy(None, SYNTHETIC, [r.prompt_token_ids for r in reqs],
                               reqs[0].sampling)  # fmt: skip
    for r, (tokens, logprobs) in zip(results, want, strict=True):
        np.testing.assert_array_equal(r.response_token_ids, tokens)
        np.testing.assert_allclose(r.logprobs, logprobs)
    for rid in ids:
        kinds = [type(e) for e in await client.store.events(rid)]
        aborted = 1 if rid in aborts else 0
        assert kinds.count(Started) == 1 and kinds.count(Finished) == 1, (rid, kinds)
        assert kinds.count(Aborted) == kinds.count(Resumed) == aborted, (rid, kinds)


async def test_after_the_queue_is_lost_each_waiting_rollout_gets_one_job_and_finishes_once(
    server: RedisServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    client, conn, url = RolloutClient(server.url), Redis.from_url(server.url), server.url
    reqs = _requests(6, 48)
    ids = await client.submit(reqs, batch_id="lost")
    aborted = await _two_aborted_with_tokens_saved(client, ids, url, tmp_path)
    ended = await _not_waiting_for_a_worker(client, ids[-1])
    waiting = ids[:-1]

    _lose_the_queue(conn)
    code, out, _ = await cli(capsys, "stuck", "--json", "--redis", url)
    assert code == 0 and out.count('"no_job"') == len(waiting)

    before = await dump(client.redis)
    code, out, err = await cli(capsys, "requeue", "--all-waiting", "--dry-run", "--redis", url)
    assert code == 0, err
    assert await dump(client.redis) == before
    *lines, summary = out.splitlines()
    assert sorted(line.split()[2] for line in lines) == sorted(waiting)
    assert summary == f"would requeue {len(waiting)} waiting rollouts; dry run: nothing written"

    # As an operator runs it: the installed entry point, in a process of its own.
    done = run_cli("requeue", "--all-waiting", "--redis", url)
    assert done.returncode == 0, done.stderr
    *lines, summary = done.stdout.splitlines()
    assert summary == f"requeued {len(waiting)} waiting rollouts"
    said = {line.split()[1]: line.split(": ", 1)[1] for line in lines}
    assert sorted(said) == sorted(waiting)
    for rid in waiting:
        saved = (await client.store.head(rid)).num_tokens
        assert said[rid] == (
            f"aborted, resumes from {saved} saved tokens"
            if rid in aborted
            else "pending, starts from the prompt"
        )
    # One job each, listed on its snapshot (its ack deletes it), none for the others.
    assert conn.llen("rq:queue:rollouts") == len(waiting)
    assert all(conn.hget(client.keys.snapshot(rid), JOB) for rid in waiting)
    await _check_a_second_run_requeues_nothing(capsys, conn, url, len(waiting))
    code, _, err = await cli(capsys, "requeue", "--all-waiting", ids[0], "--redis", url)
    assert (code, err) == (2, "rollouts requeue: error: name rollout IDs or --all-waiting, "
                              "not both and not neither\n")  # fmt: skip
    code, _, err = await cli(capsys, "requeue", "--redis", url)
    assert code == 2 and "not both and not neither" in err

    b = start_worker(url, SYNTHETIC, "b", tmp_path / "b.log", *FAST, concurrency=4,
                     synthetic={"token_delay_s": 0.0})  # fmt: skip
    try:
        await _check_ran_once(client, reqs[:-1], waiting, aborted)
    finally:
        stop(b)
    assert (await client.store.head(ended)).status is Status.CANCELLED
    ep = await client.store.head("ep")
    assert ep.status is Status.AWAITING_TOOL and ep.seq == 4
    assert conn.llen("rq:queue:rollouts") == 0
    code, out, _ = await cli(capsys, "stuck", "--redis", url)
    assert (code, out) == (0, "no stuck rollouts\n")
    conn.close()
    await client.aclose()


async def _two_aborted_with_tokens_saved(
    client: RolloutClient, ids: list[str], url: str, tmp_path: Path
) -> set[str]:
    """Worker a saves some tokens of two rollouts, then stops (SIGTERM): it aborts them with
    their tokens saved and gives their jobs back. The two."""
    a = start_worker(url, SYNTHETIC, "a", tmp_path / "a.log", *FAST, concurrency=2,
                     synthetic={"token_delay_s": 0.02})  # fmt: skip
    try:
        await until(lambda: _generating_two(client, ids), what="worker a never saved")
    finally:
        stop(a)
    aborted = {rid for rid in ids if (await client.store.head(rid)).status is Status.ABORTED}
    assert len(aborted) == 2, aborted
    return aborted


async def _not_waiting_for_a_worker(client: RolloutClient, rid: str) -> str:
    """Two rollouts that must never be requeued: ``rid`` cancelled (ended), and an episode
    "ep" waiting for a tool (its call waits on the environment queue, which is not rq's)."""
    [ended] = await client.cancel([rid])
    s = await client.store.append(None, f.episode_submitted("ep"))
    s = await client.store.append(s, f.started(s))
    s = await client.store.append(s, f.tokens(s, n=3))
    await client.store.append(s, f.requested(s))
    return ended


async def _check_a_second_run_requeues_nothing(
    capsys: pytest.CaptureFixture[str], conn: Redis, url: str, n: int
) -> None:
    code, out, _ = await cli(capsys, "requeue", "--all-waiting", "--redis", url)
    assert (code, out) == (0, f"requeued 0 waiting rollouts; left alone: {n} with a job\n")
    assert conn.llen("rq:queue:rollouts") == n


async def _generating_two(client: RolloutClient, ids: list[str]) -> bool:
    return len(await _generating(client, ids, 8)) == 2


async def test_rollouts_generating_when_the_queue_is_lost_are_left_alone_and_finish(
    server: RedisServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    client, conn, url = RolloutClient(server.url), Redis.from_url(server.url), server.url
    reqs = _requests(4, 64)
    ids = await client.submit(reqs, batch_id="live")
    # 50 ms a token: the two rollouts it runs generate for ~3 s, the other two wait.
    w = start_worker(url, SYNTHETIC, "w", tmp_path / "w.log", *FAST, concurrency=2,
                     synthetic={"token_delay_s": 0.05})  # fmt: skip
    try:
        await until(lambda: _generating_two(client, ids), what="worker w never saved")
        live = await _generating(client, ids, 8)
        _lose_the_queue(conn)
        code, out, err = await cli(capsys, "requeue", "--all-waiting", "--redis", url)
        assert code == 0, err
        # Still generating under their valid leases after the command: never requeued.
        assert await _generating(client, live, 8) == live
        *lines, summary = out.splitlines()
        assert sorted(line.split()[1] for line in lines) == sorted(set(ids) - set(live))
        assert summary == "requeued 2 waiting rollouts"
        code, _, err = await cli(capsys, "requeue", live[0], "--redis", url)
        assert code == 1 and f"rollout {live[0]!r} is generating on w (lease valid" in err
        await _check_ran_once(client, reqs, ids, set())
    finally:
        stop(w)
    assert conn.llen("rq:queue:rollouts") == 0
    conn.close()
    await client.aclose()


async def test_with_no_operator_a_workers_stranded_net_recovers_a_lost_queue(
    server: RedisServer,
) -> None:
    # The net's check (a SET NX token per interval) sees more rollouts needing a job than
    # jobs, scans, and requeues the waiting ones; the generating one finishes where it runs.
    client, conn = RolloutClient(server.url), Redis.from_url(server.url)
    reqs = _requests(4, 48)
    ids = await client.submit(reqs, batch_id="net")
    worker = Worker(
        WorkerConfig(redis_url=server.url, name="w", max_concurrency=1, stranded_check_s=0.2),
        SyntheticEngine(tokens_per_chunk=1, token_delay_s=0.02),
    )
    task = asyncio.create_task(worker.run())
    try:
        await until(lambda: _generating_one(client, ids), what="the worker never saved")
        _lose_the_queue(conn)
        await _check_ran_once(client, reqs, ids, set())
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, 60)
    assert worker.reaper is not None and worker.reaper.stranded is not None
    assert worker.reaper.stranded.requeued == len(ids) - 1  # all but the live one
    conn.close()
    await client.aclose()


async def _generating_one(client: RolloutClient, ids: list[str]) -> bool:
    return len(await _generating(client, ids, 8)) == 1
