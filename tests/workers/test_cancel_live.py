"""Cancel of a live rollout, with a real redis-server and a real worker process on the paced
synthetic engine: the worker learns it from its next checkpoint (refused as stale), aborts the
engine request, keeps the saved tokens, and is free for the next rollout at once."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import numpy as np
import pytest
from redis import Redis
from rq.registry import FailedJobRegistry

from statemachine import RolloutRequest, Started, Status
from store.client import RolloutClient
from store.queue import rollout_queue
from store.redis_server import RedisServer
from tests.workers.helpers import SYNTHETIC, direct_greedy, greedy, start_worker, stop, until

pytestmark = pytest.mark.redis_server


async def test_cancelling_a_generating_rollout_frees_its_worker(
    server: RedisServer, tmp_path: Path
) -> None:
    client = RolloutClient(server.url)
    long_run = greedy(4000)  # 20 s at the paced engine's 200 tokens/s: far from done
    prompts = [(3, 5, 7), (11, 13)]
    first, second = await client.submit(
        [RolloutRequest(prompt_token_ids=prompts[0], sampling=long_run)]
    ) + await client.submit([RolloutRequest(prompt_token_ids=prompts[1], sampling=greedy(40))])
    log = tmp_path / "w.log"
    # One slot: the second rollout can only start once the first lets go of the engine.
    worker = start_worker(server.url, SYNTHETIC, "wc", log, concurrency=1)
    try:

        async def saved() -> bool:
            return (await client.store.load(first)).num_tokens >= 32

        await until(saved, 60, "the first rollout saved no tokens")
        cancelled_at = time.time()
        assert await client.cancel([first]) == [first]
        assert (await client.store.load(first)).status is Status.CANCELLED

        async def second_started() -> bool:
            return any(isinstance(e, Started) for e in await client.store.events(second))

        await until(second_started, 10, "the worker did not let go of the cancelled rollout")
        started = next(e for e in await client.store.events(second) if isinstance(e, Started))
        # Within about a checkpoint interval (0.25 s) plus a dequeue, not the 20 s left.
        assert started.at - cancelled_at < 2.0
        [done] = await client.wait([second], timeout=30)
        assert done.status is Status.DONE
        await asyncio.sleep(0.5)  # anything the worker would still append to the first
    finally:
        stop(worker)
    assert worker.returncode == 0

    # The saved tokens stay, and they are the uninterrupted run's first tokens.
    result = await client.result(first)
    assert result.status is Status.CANCELLED
    n = len(result.response_token_ids)
    assert 32 <= n < 4000
    [(reference, logprobs)] = await direct_greedy(None, SYNTHETIC, [prompts[0]], long_run)
    np.testing.assert_array_equal(result.response_token_ids, reference[:n])
    np.testing.assert_array_equal(result.logprobs, logprobs[:n])
    # Nothing was appended after the Cancelled.
    assert type((await client.store.events(first))[-1]).__name__ == "Cancelled"

    # rq: no failed job; the fenced job is superseded, not failed or retried.
    queue = rollout_queue(Redis.from_url(server.url))
    assert FailedJobRegistry(queue=queue).count == 0
    assert queue.count == 0
    text = log.read_text()
    assert "ERROR" not in text and "Traceback" not in text, text
    assert text.count(f"rollout {first} ended cancelled while generating") == 1, text
    summary = json.loads(text.strip().splitlines()[-1])
    assert summary["outcomes"] == {"lost": 1, "finished": 1}
    await client.aclose()
