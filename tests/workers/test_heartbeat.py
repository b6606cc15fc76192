"""The worker's heartbeat renews its leases whatever rq's bookkeeping is doing.

Seen in the soak (issue 28, ``no_worker_lost_of_a_live_worker``): a live worker's leases
lapsed and were reaped, 4 at a time, while its event loop went on (it logged weight updates
meanwhile). Its lease renewals waited, in the heartbeat's one loop, for rq's heartbeat of its
jobs, which runs on the bridge's bookkeeping thread behind whatever is queued there (the
sweep of abandoned jobs, starts, ends; slow on a loaded machine, and slower still under
libfaketime): a few seconds there were a lease TTL without renewals.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from store.client import RolloutClient
from store.leases import Leases
from store.redis_server import RedisServer
from tests import factories as f
from workers.engines.synthetic import SyntheticEngine
from workers.rq_mirror import RqBooks
from workers.worker import Worker, WorkerConfig

pytestmark = pytest.mark.redis_server


async def test_leases_are_renewed_while_rqs_bookkeeping_is_held_up(
    server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = RolloutClient(server.url)
    (rid,) = await client.submit([f.request(800)])  # ~8 s at 10 ms a token
    real_beat = RqBooks.beat
    held = threading.Event()

    def slow_beat(self: RqBooks, started: list[Any]) -> None:
        if started and not held.is_set():
            held.set()
            time.sleep(4.0)  # the books thread busy for longer than a lease TTL (2 s)
        real_beat(self, started)

    monkeypatch.setattr(RqBooks, "beat", slow_beat)
    config = WorkerConfig(redis_url=server.url, burst=True, max_concurrency=1,
                          lease_ttl_s=2.0, heartbeat_s=0.25, rq_execution_ttl_s=3.0)  # fmt: skip
    worker = asyncio.create_task(
        Worker(config, SyntheticEngine(tokens_per_chunk=1, token_delay_s=0.01)).run()
    )
    leases = Leases(client.redis)
    lowest: list[int] = []
    try:
        while not worker.done():
            view = await leases.read([rid])
            left = view.left_ms(rid)
            if left is not None:
                lowest.append(left)
            await asyncio.sleep(0.05)
        await worker
        [result] = await client.wait([rid], timeout=10)
    finally:
        if not worker.done():
            worker.cancel()
        await client.aclose()
    assert held.is_set() and lowest, "the rq heartbeat was never held up"
    assert result.status.value == "done"
    # Renewed every 0.25 s throughout: never less than a TTL minus a beat or two left.
    assert min(lowest) > 1000, min(lowest)


async def test_a_held_up_loop_is_said_in_the_log(
    server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A beat that comes more than half a lease TTL after the last is logged with its gap: the
    leases may lapse then, and the log says why a reaper took the rollouts over."""
    client = RolloutClient(server.url)
    (rid,) = await client.submit([f.request(300)])  # ~3 s at 10 ms a token
    config = WorkerConfig(redis_url=server.url, burst=True, max_concurrency=1,
                          lease_ttl_s=2.0, heartbeat_s=0.25)  # fmt: skip
    worker = asyncio.create_task(
        Worker(config, SyntheticEngine(tokens_per_chunk=1, token_delay_s=0.01)).run()
    )
    try:
        while (await client.store.load(rid)).num_tokens == 0:
            await asyncio.sleep(0.05)
        with caplog.at_level("WARNING", logger="rollouts.worker"):
            time.sleep(1.5)  # the worker's loop (this one) held up, as by a long step on it
            await worker
        [result] = await client.wait([rid], timeout=10)
    finally:
        if not worker.done():
            worker.cancel()
        await client.aclose()
    late = [r.getMessage() for r in caplog.records if "heartbeat late" in r.getMessage()]
    # The held-up beat is said with its gap (1.5 s and the beat's own wait); on a loaded
    # machine another may follow, so the first is the one checked.
    assert late, "a beat 1.5 s late was not logged"
    gap = float(late[0].removeprefix("heartbeat late: ").split()[0])
    assert gap >= 1.4 and "leases last 2.0 s" in late[0], late
    assert result.status.value == "done" and result.aborts == 0  # 1.5 s < the TTL: kept
