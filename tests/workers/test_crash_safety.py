"""kill -9 a worker, stall one, deliver a job twice, restart Redis: nothing is lost or doubled.

These are about the worker, not the model: they run worker processes on the synthetic engine
(resume-exact and paced like the CPU engine, `tests.workers.helpers.SYNTHETIC_PACE`) and compare
with its uninterrupted output. A kill -9 resume is also run on the CPU engine (greedy equality
of a real model across a resume), and the engine-death test kills the CPU engine's core
process: both are `slow`."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from redis import Redis

from statemachine import (
    LIVE,
    Aborted,
    AbortReason,
    RolloutRequest,
    Status,
    TokensAppended,
)
from store.client import RolloutClient
from store.queue import enqueue_rollouts, rollout_queue
from store.redis_server import RedisServer
from tests.engine_pool import EnginePool
from tests.workers.helpers import (
    SYNTHETIC,
    direct_greedy,
    greedy,
    random_prompts,
    start_worker,
    stop,
    until,
)

pytestmark = pytest.mark.redis_server

FAST = ("--lease-ttl", "2", "--heartbeat", "0.25")  # recovery in seconds, for the tests
K = 8  # checkpoint every 8 tokens (start_worker's default)
# For a worker that only finishes what another left: its pace matters to nothing tested.
UNPACED = {"token_delay_s": 0.0}


def prompts(n: int, seed: int = 0) -> list[tuple[int, ...]]:
    return random_prompts(n, seed, length=5)


async def tokens_of(client: RolloutClient, rid: str) -> int:
    return (await client.store.load(rid)).num_tokens


@pytest.fixture(params=["synthetic", pytest.param("cpu", marks=pytest.mark.slow)])
def model(request: pytest.FixtureRequest) -> Path | None:
    """The workers' model: the tiny dense model on the CPU engine, or SYNTHETIC."""
    return request.getfixturevalue("tiny_dense_dir") if request.param == "cpu" else SYNTHETIC


async def test_kill_9_mid_generation_resumes_elsewhere(
    cpu_pool: EnginePool, server: RedisServer, model: Path | None, tmp_path: Path
) -> None:
    client = RolloutClient(server.url)
    prompt, n = prompts(1)[0], 96
    [rid] = await client.submit([RolloutRequest(prompt_token_ids=prompt, sampling=greedy(n))])
    a = start_worker(server.url, model, "a", tmp_path / "a.log", *FAST, concurrency=1)
    b = None
    try:
        await until(lambda: _at_least(client, rid, 2 * K))
        a.kill()  # SIGKILL: no chance to save anything
        a.wait(10)
        saved = await tokens_of(client, rid)
        b = start_worker(
            server.url, model, "b", tmp_path / "b.log", *FAST, concurrency=1, synthetic=UNPACED
        )
        [result] = await client.wait([rid], timeout=180)
    finally:
        stop(a, *(p for p in [b] if p))
    [(ref, _)] = await direct_greedy(cpu_pool, model, [prompt], greedy(n))
    np.testing.assert_array_equal(result.response_token_ids, ref)
    events = await client.store.events(rid)
    lost = [e for e in events if isinstance(e, Aborted)]
    assert [e.reason for e in lost] == [AbortReason.WORKER_LOST]
    # Attempt 2 resumed exactly where the last checkpoint of attempt 1 ended ...
    first_of_2 = next(e for e in events if isinstance(e, TokensAppended) and e.attempt == 2)
    assert first_of_2.offset == saved >= 2 * K
    # ... and attempt 1 never held much more than one checkpoint interval unsaved. The bound
    # is K tokens plus what arrives while its previous checkpoint is in flight (generation
    # never waits for Redis): CI on 2 loaded cores saw a chunk of K + 1, so allow one more
    # interval's worth, not more (both engines yield one token per step here).
    sizes = [len(e) for e in events if isinstance(e, TokensAppended) and e.attempt == 1]
    assert sizes and max(sizes) <= 2 * K


async def _at_least(client: RolloutClient, rid: str, n: int) -> bool:
    return await tokens_of(client, rid) >= n


async def test_stalled_worker_is_fenced_out_and_carries_on(
    server: RedisServer, tmp_path: Path
) -> None:
    client = RolloutClient(server.url)
    ps = prompts(2, seed=1)
    [rid] = await client.submit([RolloutRequest(prompt_token_ids=ps[0], sampling=greedy(200))])
    a = start_worker(
        server.url,
        SYNTHETIC,
        "stalled",
        tmp_path / "a.log",
        *FAST,
        "--checkpoint-tokens",
        "2",
        concurrency=1,
    )
    b = None
    try:
        await until(lambda: _at_least(client, rid, 8))
        os.kill(a.pid, signal.SIGSTOP)  # stalled past its lease: alive, but silent
        b = start_worker(server.url, SYNTHETIC, "rescuer", tmp_path / "b.log", *FAST, concurrency=1)
        await until(lambda: _attempt_at_least(client, rid, 2))
        await until(lambda: _at_least(client, rid, 40))
        os.kill(a.pid, signal.SIGCONT)  # it wakes up and tries to append its buffered tokens
        [result] = await client.wait([rid], timeout=180)
        # The stalled worker survived being fenced out and takes new work (the rescuer is gone
        # first, or it may take the job before its SIGTERM lands).
        stop(b)
        [other] = await client.submit([RolloutRequest(prompt_token_ids=ps[1], sampling=greedy(16))])
        [other_result] = await client.wait([other], timeout=120)
        assert a.poll() is None
    finally:
        stop(a, *(p for p in [b] if p))
    [(ref, _)] = await direct_greedy(None, SYNTHETIC, [ps[0]], greedy(200))
    np.testing.assert_array_equal(result.response_token_ids, ref)
    state = await client.store.load(rid)
    assert state == await client.store.replay(rid)
    events = await client.store.events(rid)
    # Nothing from attempt 1 after the takeover: every attempt-1 event precedes the abort.
    abort_seq = next(e.seq for e in events if isinstance(e, Aborted))
    assert all(getattr(e, "attempt", 1) != 1 or e.seq <= abort_seq for e in events)
    assert other_result.status is Status.DONE
    assert (await client.store.events(other))[1].worker_id == "stalled"


async def _attempt_at_least(client: RolloutClient, rid: str, n: int) -> bool:
    return (await client.store.load(rid)).attempt >= n


async def test_duplicate_job_runs_are_exactly_once(server: RedisServer, tmp_path: Path) -> None:
    client = RolloutClient(server.url)
    ps = prompts(3, seed=2)
    ids = await client.submit([RolloutRequest(prompt_token_ids=p, sampling=greedy(48)) for p in ps])
    # rq is at-least-once: deliver every job twice more, to several workers at once.
    queue = rollout_queue(Redis.from_url(server.url))
    enqueue_rollouts(queue, ids)
    enqueue_rollouts(queue, ids)
    workers = [
        start_worker(server.url, SYNTHETIC, f"d{i}", tmp_path / f"d{i}.log", *FAST, concurrency=2)
        for i in range(3)
    ]
    try:
        results = await client.wait(ids, timeout=180)
        await until(lambda: _queue_empty(queue), timeout=60)
    finally:
        stop(*workers)
    reference = await direct_greedy(None, SYNTHETIC, ps, greedy(48))
    for rid, r, (ref, _) in zip(ids, results, reference, strict=True):
        np.testing.assert_array_equal(r.response_token_ids, ref)
        events = await client.store.events(rid)
        offsets = [e.offset for e in events if isinstance(e, TokensAppended)]
        sizes = [len(e) for e in events if isinstance(e, TokensAppended)]
        assert offsets == list(np.cumsum([0, *sizes])[:-1]) and sum(sizes) == 48


async def _queue_empty(queue) -> bool:  # type: ignore[no-untyped-def]
    return queue.count == 0


async def test_redis_restart_while_generating(server: RedisServer, tmp_path: Path) -> None:
    client = RolloutClient(server.url)
    ps = prompts(6, seed=3)
    ids = await client.submit([RolloutRequest(prompt_token_ids=p, sampling=greedy(64)) for p in ps])
    workers = [
        start_worker(server.url, SYNTHETIC, f"r{i}", tmp_path / f"r{i}.log", *FAST, concurrency=3)
        for i in range(2)
    ]
    try:
        await until(lambda: _at_least(client, ids[0], 8))
        await asyncio.to_thread(server.restart, kill=True)  # SIGKILL; AOF fsync always
        results = await client.wait(ids, timeout=240)
    finally:
        stop(*workers)
    reference = await direct_greedy(None, SYNTHETIC, ps, greedy(64))
    for rid, r, (ref, _) in zip(ids, results, reference, strict=True):
        assert r.status is Status.DONE
        np.testing.assert_array_equal(r.response_token_ids, ref)
        assert await client.store.load(rid) == await client.store.replay(rid)


async def test_bounded_chaos(server: RedisServer, tmp_path: Path) -> None:
    """Workers killed at random, Redis restarted, one weight update.

    The steps come at random points of the work's progress (not of the clock, which made the
    kills miss on a machine fast enough to finish first), each kill hits a worker that holds a
    live rollout, and the test then checks that every rollout still ends exactly right."""
    rng = random.Random(11)
    client = RolloutClient(server.url)
    ps = prompts(16, seed=4)
    n = 320
    ids = await client.submit([RolloutRequest(prompt_token_ids=p, sampling=greedy(n)) for p in ps])
    n_started = 0
    names: dict[subprocess.Popen[bytes], str] = {}

    def spawn() -> subprocess.Popen[bytes]:
        nonlocal n_started
        n_started += 1
        name = f"c{n_started}"
        proc = start_worker(
            server.url, SYNTHETIC, name, tmp_path / f"{name}.log", *FAST, concurrency=3
        )
        names[proc] = name
        return proc

    workers = [spawn(), spawn()]
    marks = sorted(rng.uniform(0.1, 0.7) for _ in range(5))  # fractions of all tokens
    try:
        for step, mark in zip(("kill", "redis", "weights", "kill", "kill"), marks, strict=True):
            await _progress_at_least(client, ids, int(mark * n * len(ids)))
            if step == "redis":
                await asyncio.to_thread(server.restart, kill=True)
            elif step == "weights":
                await client.publish_weights(1, str(tmp_path))  # same "weights", new version
            else:
                busy = await _busy(client, ids, workers, names) or workers
                victim = busy[rng.randrange(len(busy))]
                workers.remove(victim)
                victim.kill()
                victim.wait(10)
                workers.append(spawn())
        results = await client.wait(ids, timeout=240)
    finally:
        stop(*workers)
    reference = await direct_greedy(None, SYNTHETIC, ps, greedy(n))
    for rid, r, (ref, _) in zip(ids, results, reference, strict=True):
        assert r.status is Status.DONE
        np.testing.assert_array_equal(r.response_token_ids, ref)
        loaded = await client.store.load(rid)
        assert loaded == await client.store.replay(rid)  # every history valid
        events = await client.store.events(rid)
        offsets = [e.offset for e in events if isinstance(e, TokensAppended)]
        sizes = [len(e) for e in events if isinstance(e, TokensAppended)]
        assert offsets == list(np.cumsum([0, *sizes])[:-1])  # each offset written once
    assert n_started == 5
    aborts = [e for rid in ids for e in await client.store.events(rid) if isinstance(e, Aborted)]
    assert any(e.reason is AbortReason.WORKER_LOST for e in aborts)  # the kills hit live work


async def _progress_at_least(client: RolloutClient, ids: list[str], tokens: int) -> None:
    deadline = time.monotonic() + 120
    while sum([await tokens_of(client, rid) for rid in ids]) < tokens:
        assert time.monotonic() < deadline, "no progress"
        await asyncio.sleep(0.1)


async def _busy(
    client: RolloutClient,
    ids: list[str],
    workers: list[subprocess.Popen[bytes]],
    names: dict[subprocess.Popen[bytes], str],
) -> list[subprocess.Popen[bytes]]:
    """The workers that hold a live rollout now."""
    states = [await client.store.load(rid) for rid in ids]
    live = {s.worker_id for s in states if s.status in LIVE}
    return [w for w in workers if names[w] in live]


async def test_sigterm_saves_progress_and_exits_promptly(
    server: RedisServer, tmp_path: Path
) -> None:
    client = RolloutClient(server.url)
    ps = prompts(2, seed=5)
    ids = await client.submit(
        [RolloutRequest(prompt_token_ids=p, sampling=greedy(600)) for p in ps]
    )
    a = start_worker(server.url, SYNTHETIC, "t", tmp_path / "t.log", *FAST, concurrency=2)
    b = None
    try:
        await until(lambda: _at_least(client, ids[0], 2 * K))
        t0 = time.monotonic()
        a.terminate()
        assert a.wait(30) == 0
        exit_s = time.monotonic() - t0
        states = [await client.store.load(rid) for rid in ids]
        # Nothing is left live: what was generating is saved and aborted for shutdown.
        assert not any(s.status in (Status.GENERATING, Status.RESUMED) for s in states)
        assert any(s.abort_reason is AbortReason.SHUTDOWN and s.num_tokens >= 2 * K for s in states)
        # Unpaced: what is tested is how `t` stopped; `t2` only finishes the work (the
        # synthetic engine's tokens do not depend on its pace; paced, this took ~3 s).
        b = start_worker(server.url, SYNTHETIC, "t2", tmp_path / "t2.log", *FAST, synthetic=UNPACED)
        results = await client.wait(ids, timeout=180)
    finally:
        stop(a, *(p for p in [b] if p))
    assert exit_s < 10
    reference = await direct_greedy(None, SYNTHETIC, ps, greedy(600))
    for r, (ref, _) in zip(results, reference, strict=True):
        np.testing.assert_array_equal(r.response_token_ids, ref)


def engine_core_pid(worker_pid: int) -> int:
    """The CPU engine's core process under a worker (its only child)."""
    with open(f"/proc/{worker_pid}/task/{worker_pid}/children") as f:
        [pid] = f.read().split()
    return int(pid)


@pytest.mark.slow
async def test_engine_death_stops_the_worker_and_charges_no_attempt(
    cpu_pool: EnginePool, server: RedisServer, tiny_dense_dir: Path, tmp_path: Path
) -> None:
    """kill -9 of a worker's engine core: its rollouts are saved and resume elsewhere."""
    client = RolloutClient(server.url)
    ps = prompts(2, seed=7)
    n = 200
    ids = await client.submit([RolloutRequest(prompt_token_ids=p, sampling=greedy(n)) for p in ps])
    log = tmp_path / "a.log"
    # One attempt allowed: an engine death must not count as the rollout's failure.
    a = start_worker(
        server.url, tiny_dense_dir, "a", log, *FAST, "--max-engine-attempts", "1", concurrency=2
    )
    b = None
    try:
        await until(lambda: _at_least(client, ids[0], 2 * K))
        await until(lambda: _at_least(client, ids[1], K))
        os.kill(engine_core_pid(a.pid), signal.SIGKILL)
        assert a.wait(30) == 1  # a supervisor restarts it with a new engine
        states = [await client.store.load(rid) for rid in ids]
        assert [s.status for s in states] == [Status.ABORTED] * 2
        assert all(s.abort_reason is AbortReason.ENGINE_DEAD for s in states)
        assert all(s.num_tokens >= K for s in states)
        b = start_worker(server.url, tiny_dense_dir, "b", tmp_path / "b.log", *FAST)
        results = await client.wait(ids, timeout=180)
    finally:
        stop(a, *(p for p in [b] if p))
    assert '"engine_dead": "EngineDead:' in log.read_text()
    reference = await direct_greedy(cpu_pool, tiny_dense_dir, ps, greedy(n))
    for r, (ref, _) in zip(results, reference, strict=True):
        assert r.status is Status.DONE
        np.testing.assert_array_equal(r.response_token_ids, ref)
    for rid in ids:
        aborts = [e for e in await client.store.events(rid) if isinstance(e, Aborted)]
        assert [e.reason for e in aborts] == [AbortReason.ENGINE_DEAD]
