"""In-flight weight updates: real worker subprocesses, a real redis-server, the CPU engine.

Where the model's output is the point (an update that changes it, drain and keep, republished
weights that must change no token of a real model) the workers run the CPU engine and the
tests are `slow`; the bookkeeping of many updates over many rollouts, and republishing on a
resume-exact engine, run on the synthetic engine."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import numpy as np
import pytest

from statemachine import (
    Aborted,
    AbortReason,
    RolloutRequest,
    Status,
    TokensAppended,
)
from store.client import RolloutClient
from store.redis_server import RedisServer
from tests.engine_pool import EnginePool
from tests.workers.helpers import (
    SYNTHETIC,
    direct_greedy,
    greedy,
    random_prompts,
    start_worker,
    stop,
)
from workers.demo.tiny_model import make_tiny_checkpoint

pytestmark = pytest.mark.redis_server


def prompts(n: int, seed: int = 0) -> list[tuple[int, ...]]:
    return random_prompts(n, seed, length=6)


async def wait_tokens(client: RolloutClient, rid: str, at_least: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while (await client.store.load(rid)).num_tokens < at_least:
        assert time.monotonic() < deadline, "no progress"
        await asyncio.sleep(0.02)


async def wait_version(
    client: RolloutClient, ids: list[str], version: int, timeout: float = 120
) -> None:
    """Until some rollout holds a token sampled on ``version`` weights."""
    deadline = time.monotonic() + timeout
    while True:
        for rid in ids:
            state = await client.store.load(rid)
            if len(state.weight_versions) and int(state.weight_versions.max()) >= version:
                return
        assert time.monotonic() < deadline, f"no token on weights v{version}"
        await asyncio.sleep(0.02)


@pytest.fixture(params=["synthetic", pytest.param("cpu", marks=pytest.mark.slow)])
def model(request: pytest.FixtureRequest) -> Path | None:
    """The workers' model: the tiny dense model on the CPU engine, or SYNTHETIC."""
    return request.getfixturevalue("tiny_dense_dir") if request.param == "cpu" else SYNTHETIC


async def test_republishing_the_same_weights_changes_no_token(
    cpu_pool: EnginePool, server: RedisServer, model: Path | None, tmp_path: Path
) -> None:
    client = RolloutClient(server.url)
    ps = prompts(8)
    n = 300  # long enough that the updates below land while generations are in flight
    ids = await client.submit([RolloutRequest(prompt_token_ids=p, sampling=greedy(n)) for p in ps])
    workers = [start_worker(server.url, model, f"w{i}", tmp_path / f"w{i}.log") for i in (1, 2)]
    rng = random.Random(7)
    try:
        await wait_tokens(client, ids[0], 1)
        for version in range(1, 5):  # aborts land at random offsets
            await asyncio.sleep(rng.uniform(0.05, 0.4))
            await client.publish_weights(version, str(model or tmp_path))
        results = await client.wait(ids, timeout=240)
    finally:
        stop(*workers)
    reference = await direct_greedy(cpu_pool, model, ps, greedy(n))
    update_aborts = 0
    for rid, r, (ref_ids, ref_lp) in zip(ids, results, reference, strict=True):
        assert r.status is Status.DONE
        np.testing.assert_array_equal(r.response_token_ids, ref_ids)
        np.testing.assert_allclose(r.logprobs, ref_lp, atol=1e-5)
        assert (np.diff(r.weight_versions) >= 0).all()
        events = await client.store.events(rid)
        update_aborts += sum(
            isinstance(e, Aborted) and e.reason is AbortReason.WEIGHT_UPDATE for e in events
        )
    assert update_aborts >= 2, "the updates never interrupted a generation"


@pytest.mark.slow
async def test_a_real_update_mid_flight_switches_exactly(
    cpu_pool: EnginePool, server: RedisServer, tiny_dense_dir: Path, tmp_path: Path
) -> None:
    other = make_tiny_checkpoint(tmp_path / "v1", like=tiny_dense_dir, seed=1)
    client = RolloutClient(server.url)
    prompt, n = prompts(1, seed=3)[0], 200
    [rid] = await client.submit([RolloutRequest(prompt_token_ids=prompt, sampling=greedy(n))])
    worker = start_worker(
        server.url,
        tiny_dense_dir,
        "w",
        tmp_path / "w.log",
        "--checkpoint-tokens",
        "1",
        concurrency=1,
    )
    try:
        await wait_tokens(client, rid, 8)
        await client.publish_weights(1, str(other))
        [result] = await client.wait([rid], timeout=240)
    finally:
        stop(worker)
    ids, versions = result.response_token_ids, result.weight_versions
    k = int((versions == 0).sum())
    assert 8 <= k < n and len(ids) == n
    # Versions mark the switch exactly: one run of v0, then one run of v1.
    assert result.version_segments == [(0, 0, k), (1, k, n)]
    [(old, _)] = await direct_greedy(cpu_pool, tiny_dense_dir, [prompt], greedy(n))
    np.testing.assert_array_equal(ids[:k], old[:k])  # before: the old model's greedy output
    [(new, _)] = await direct_greedy(cpu_pool, other, [(*prompt, *ids[:k].tolist())], greedy(n - k))
    np.testing.assert_array_equal(ids[k:], new)  # after: the new model's continuation
    assert not np.array_equal(ids[k:], old[k:])  # and the new weights really are different
    events = await client.store.events(rid)
    aborted = [e for e in events if isinstance(e, Aborted)]
    assert [e.reason for e in aborted] == [AbortReason.WEIGHT_UPDATE]
    assert "mode=abort" in aborted[0].detail


async def test_64_rollouts_through_5_updates_lose_and_duplicate_nothing(
    server: RedisServer, tmp_path: Path
) -> None:
    """Bookkeeping, not the model: synthetic workers (real checkpoint loads are the slow
    tests')."""
    client = RolloutClient(server.url)
    n = 32
    ids = await client.submit(
        [RolloutRequest(prompt_token_ids=p, sampling=greedy(n)) for p in prompts(64, seed=5)]
    )
    workers = [
        # 50 tokens/s: the five updates land before the 64 rollouts are done.
        start_worker(
            server.url,
            SYNTHETIC,
            f"u{i}",
            tmp_path / f"u{i}.log",
            concurrency=4,
            synthetic={"token_delay_s": 0.02},
        )
        for i in (1, 2)
    ]
    try:
        await wait_tokens(client, ids[0], 1)
        for version in range(1, 6):  # five updates in a row while generating
            await client.publish_weights(version, str(tmp_path / f"v{version}"))
            # The next one only once some rollout samples on this one (a fixed pause let all
            # 64 finish before the third update on a fast machine: CI saw max version 2).
            await wait_version(client, ids, version)
        results = await client.wait(ids, timeout=300)
    finally:
        stop(*workers)
    assert all(r.status is Status.DONE and len(r.response_token_ids) == n for r in results)
    for rid in ids:
        loaded, replayed = await client.store.load(rid), await client.store.replay(rid)
        assert loaded == replayed  # every history is valid against the transition table
        offsets = [
            e.offset for e in await client.store.events(rid) if isinstance(e, TokensAppended)
        ]
        sizes = [len(e) for e in await client.store.events(rid) if isinstance(e, TokensAppended)]
        assert offsets == list(np.cumsum([0, *sizes])[:-1])  # each offset written exactly once
    assert max(int(r.weight_versions.max()) for r in results) == 5


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["drain", "keep"])
async def test_drain_and_keep_modes(
    cpu_pool: EnginePool, server: RedisServer, tiny_dense_dir: Path, tmp_path: Path, mode: str
) -> None:
    other = make_tiny_checkpoint(tmp_path / "v1", like=tiny_dense_dir, seed=1)
    client = RolloutClient(server.url)
    prompt, n = prompts(1, seed=9)[0], 200
    [rid] = await client.submit([RolloutRequest(prompt_token_ids=prompt, sampling=greedy(n))])
    worker = start_worker(
        server.url,
        tiny_dense_dir,
        f"m-{mode}",
        tmp_path / "m.log",
        "--checkpoint-tokens",
        "1",
        "--weight-mode",
        mode,
        concurrency=1,
    )
    try:
        await wait_tokens(client, rid, 8)
        await client.publish_weights(1, str(other))
        [result] = await client.wait([rid], timeout=240)
        # A rollout submitted after the update runs on the new weights in both modes.
        [late] = await client.submit([RolloutRequest(prompt_token_ids=prompt, sampling=greedy(8))])
        [late_result] = await client.wait([late], timeout=120)
    finally:
        stop(worker)
    events = await client.store.events(rid)
    assert not any(isinstance(e, Aborted) for e in events)  # neither mode aborts
    assert events[1].weight_mode == mode  # the deployment's mode is in the log
    ids, versions = result.response_token_ids, result.weight_versions
    [(old, _)] = await direct_greedy(cpu_pool, tiny_dense_dir, [prompt], greedy(n))
    if mode == "drain":
        # In-flight work finished on the old weights; the switch waited for it.
        assert result.version_segments == [(0, 0, n)]
        np.testing.assert_array_equal(ids, old)
    else:
        # Kept in flight: the engine switched between two steps and recomputed the KV.
        k = int((versions == 0).sum())
        assert 8 <= k < n and result.version_segments == [(0, 0, k), (1, k, n)]
        np.testing.assert_array_equal(ids[:k], old[:k])
        [(new, _)] = await direct_greedy(
            cpu_pool, other, [(*prompt, *ids[:k].tolist())], greedy(n - k)
        )
        np.testing.assert_array_equal(ids[k:], new)
    assert (late_result.weight_versions == 1).all()


async def test_a_checkpoint_the_engine_refuses_leaves_the_worker_serving(
    cpu_pool: EnginePool, server: RedisServer, tiny_dense_dir: Path, tmp_path: Path
) -> None:
    """A bad publish is logged and skipped: the worker serves on, and follows the next one."""
    from workers.worker import Worker, WorkerConfig

    engine = await cpu_pool.get(tiny_dense_dir)
    worker = Worker(WorkerConfig(redis_url=server.url, queues=("q",), max_concurrency=2), engine)
    running = asyncio.create_task(worker.run())
    client = RolloutClient(server.url, queue_name="q")
    try:
        await client.publish_weights(1, str(tmp_path / "no-such-checkpoint"))
        request = RolloutRequest(prompt_token_ids=(5, 6, 7), sampling=greedy(8))
        [rid] = await client.submit([request])
        [result] = await client.wait([rid], timeout=60)
        assert result.status is Status.DONE and (result.weight_versions == 0).all()
        await client.publish_weights(2, str(tiny_dense_dir))
        deadline = time.monotonic() + 60
        while engine.weight_version != 2:
            assert time.monotonic() < deadline, "the worker stopped following weights"
            await asyncio.sleep(0.05)
        assert not running.done()
    finally:
        worker.request_stop()
        await running
        await client.aclose()
