"""The trainer API against real worker processes and a real redis-server of the test's own:
completion order across workers of different speeds, take=k on a long tail, a trainer that
restarts and re-attaches, a Redis restart while results stream, and Redis memory back at its
baseline once everything is acknowledged."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import redis.asyncio as aredis

from statemachine import Finished, RolloutRequest, Status
from store.client import RolloutClient
from store.redis_server import RedisServer
from tests.workers.helpers import SYNTHETIC, greedy, random_prompts, start_worker, stop, until


def requests(n: int, max_tokens: int | list[int], seed: int = 0) -> list[RolloutRequest]:
    budgets = max_tokens if isinstance(max_tokens, list) else [max_tokens] * n
    return [
        RolloutRequest(prompt_token_ids=p, sampling=greedy(m))
        for p, m in zip(random_prompts(n, seed), budgets, strict=True)
    ]


async def settle(redis: aredis.Redis) -> None:
    """Until the worker's rq bookkeeping of its last jobs is done (it runs just after each
    rollout ends, so a trainer that acks at once can be ahead of it) and its heartbeat is
    published."""

    async def idle() -> bool:
        started = await redis.zcard("rq:wip:rollouts") + await redis.zcard("rq:started:rollouts")
        return started == 0 and await redis.exists("dr:workers") == 1

    await until(idle, 30, "the worker's bookkeeping did not settle")
    # Execution records expire a heartbeat TTL after their job ended.
    await until(lambda: _no_executions(redis), 30, "execution records stayed")
    # A job whose rollout was acknowledged while it was still started is deleted by its
    # worker just after rq's success wrote it (workers/rq_mirror.py): a moment after the
    # started registry emptied. Under load that moment is long enough to see.
    await until(lambda: _no_jobs(redis), 30, "jobs of acknowledged rollouts stayed")


async def _no_jobs(redis: aredis.Redis) -> bool:
    return not await redis.keys("rq:job:*") and not await redis.keys("rq:results:*")


async def _no_executions(redis: aredis.Redis) -> bool:
    return not await redis.keys("rq:execution:*")


async def test_results_follow_completion_across_workers_of_different_speeds(
    server: RedisServer, tmp_path: Path
) -> None:
    fast = start_worker(server.url, SYNTHETIC, "fast", tmp_path / "fast.log", concurrency=4,
                        synthetic={"token_delay_s": 0.001})  # fmt: skip
    slow = start_worker(server.url, SYNTHETIC, "slow", tmp_path / "slow.log", concurrency=4,
                        synthetic={"token_delay_s": 0.02})  # fmt: skip
    client = RolloutClient(server.url)
    try:

        async def both_up() -> bool:
            return {w.worker_id for w in (await client.stats()).workers} >= {"fast", "slow"}

        # Both taking jobs before any is submitted: otherwise the fast one could end all 16
        # before the slow one is up (CI saw that once).
        await until(both_up, 60, "the workers did not start")
        batch = await client.submit(requests(8, 24), n=2, batch_id="speeds")
        results = [r async for r in client.results("speeds", timeout=120)]
        assert sorted(r.rollout_id for r in results) == sorted(batch)
        assert all(r.status is Status.DONE and len(r.response_token_ids) == 24 for r in results)
        # Delivered in the order the Finished events were appended, whoever ran them.
        ends = []
        for r in results:
            events = await client.store.events(r.rollout_id)
            ends.append(next(e.at for e in events if isinstance(e, Finished)))
        assert ends == sorted(ends)
        workers = {(await client.store.load(r.rollout_id)).worker_id for r in results}
        assert workers == {"fast", "slow"}
    finally:
        stop(fast, slow)
        await client.aclose()


async def test_take_k_returns_the_first_groups_and_cancels_the_long_tail(
    server: RedisServer, tmp_path: Path
) -> None:
    worker = start_worker(server.url, SYNTHETIC, "w", tmp_path / "w.log", concurrency=16)
    client = RolloutClient(server.url)
    try:
        # Four short groups and four that would take a minute.
        budgets = [8] * 4 + [12_000] * 4
        await client.submit(requests(8, budgets), n=2, batch_id="tail")
        groups = [g async for g in client.groups("tail", take=4, timeout=60)]
        assert sorted(g.group_index for g in groups) == [0, 1, 2, 3]
        assert all(r.status is Status.DONE for g in groups for r in g.results)
        info = await client.batch("tail")
        tail = [rid for g in range(4, 8) for rid in info.group_ids(g)]

        async def all_cancelled() -> bool:
            return set(await client.statuses(tail)) == {"cancelled"}

        await until(all_cancelled, 10, "the tail was not cancelled")
        # The worker let go of them: the next batch runs at once.
        batch = await client.submit(requests(2, 8, seed=1), batch_id="next")
        done = await client.wait(list(batch), timeout=30)
        assert [r.status for r in done] == [Status.DONE] * 2
    finally:
        stop(worker)
        await client.aclose()


async def test_a_restarted_trainer_reattaches_without_losing_or_repeating_a_result(
    server: RedisServer, tmp_path: Path
) -> None:
    worker = start_worker(server.url, SYNTHETIC, "w", tmp_path / "w.log", concurrency=8)
    first = RolloutClient(server.url)
    batch = await first.submit(requests(12, 16), batch_id="step-1")
    seen: list[str] = []
    position = ""
    async for r in first.results("step-1", timeout=60):
        seen.append(r.rollout_id)
        position = r.position
        if len(seen) == 5:
            break  # the trainer "crashes" here
    await first.aclose()
    second = RolloutClient(server.url)
    try:
        assert await second.batches() == ["step-1"]
        async for r in second.results("step-1", after=position, timeout=60):
            seen.append(r.rollout_id)
        assert sorted(seen) == sorted(batch) and len(seen) == len(set(seen))
    finally:
        stop(worker)
        await second.aclose()


@pytest.mark.slow
async def test_results_keep_streaming_across_a_redis_restart(
    server: RedisServer, tmp_path: Path
) -> None:
    worker = start_worker(server.url, SYNTHETIC, "w", tmp_path / "w.log", concurrency=4)
    client = RolloutClient(server.url)
    try:
        batch = await client.submit(requests(16, 48), batch_id="restart")
        seen: list[str] = []

        async def consume() -> None:
            async for r in client.results("restart", timeout=180):
                seen.append(r.rollout_id)

        reader = asyncio.create_task(consume())
        while len(seen) < 3:
            await asyncio.sleep(0.05)
        server.restart(kill=True)  # AOF always: every acknowledged write survives
        await asyncio.wait_for(reader, 180)
        assert sorted(seen) == sorted(batch) and len(seen) == len(set(seen))
    finally:
        stop(worker)
        await client.aclose()


async def data_memory(redis: aredis.Redis) -> int:
    """Redis's used memory without its connections' buffers. Those grow to the largest
    pipeline a connection sent or read (a worker that starts 32 jobs at once, a checkpoint of
    64 rollouts) and Redis shrinks them on its own schedule; they hold no rollout's data."""
    info = await redis.info("memory")
    return int(info["used_memory"]) - int(info["mem_clients_normal"]) - int(info["mem_aof_buffer"])


@pytest.mark.slow
async def test_redis_memory_is_back_at_baseline_after_acknowledging_everything(
    server: RedisServer, tmp_path: Path
) -> None:
    worker = start_worker(server.url, SYNTHETIC, "w", tmp_path / "w.log", concurrency=64,
                          synthetic={"token_delay_s": 0.0})  # fmt: skip
    client = RolloutClient(server.url)
    redis = aredis.Redis.from_url(server.url)
    try:
        # A first batch creates what stays for good (counters, rq's queue set, the worker).
        warm = await client.submit(requests(4, 16), batch_id="warm")
        await client.wait(list(warm), timeout=60)
        await client.ack(batch_id="warm")
        await settle(redis)
        await redis.memory_purge()
        keys_before = set(await redis.keys("*"))
        memory_before = await data_memory(redis)

        batch = await client.submit(requests(250, 16, seed=2), n=4, batch_id="big")
        assert len(batch) == 1000
        groups = 0
        async for g in client.groups("big", timeout=300):
            assert g.complete and all(r.status is Status.DONE for r in g.results)
            report = await client.ack(g.rollout_ids)
            assert report.acked == g.rollout_ids
            groups += 1
        assert groups == 250
        await client.ack(batch_id="big")
        await settle(redis)

        async def baseline_keys() -> bool:
            # The worker's own rq keys come and go with its heartbeat: compare until equal.
            return set(await redis.keys("*")) == keys_before

        async def difference() -> str:
            now = set(await redis.keys("*"))
            return f"keys added: {now - keys_before}, keys gone: {keys_before - now}"

        try:
            await until(baseline_keys, 10)
        except AssertionError:
            raise AssertionError(await difference()) from None
        await redis.memory_purge()
        memory_after = await data_memory(redis)
        assert memory_after / memory_before <= 1.05, (memory_before, memory_after)
    finally:
        stop(worker)
        await client.aclose()
        await redis.aclose()
