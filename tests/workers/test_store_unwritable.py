"""Redis refusing writes for a condition of its own is a store condition, not a lost worker.

Real redis-server, real worker processes on the paced synthetic engine, JSON logs and
/metrics. Mid-run the test makes Redis refuse every write (out of memory under ``noeviction``;
a failed RDB save with ``stop-writes-on-bgsave-error``), holds the condition longer than a
lease TTL (so every lease lapses while nobody can renew it), then lifts it. Every rollout must
end exactly as an uninterrupted run, with no ``worker_lost`` or ``engine_error`` abort, no
failed rollout or rq job; each worker logs the episode once (its start and its end, and no
traceback), and ``rollouts status --json`` and each worker's gauge show it while it holds.

Before (issue 28): a refused checkpoint failed the whole run, its unsaved tokens were dropped,
the job went back, the next worker found the old lease live and superseded it, and only the
reaper recovered the rollout (27 ``worker_lost`` aborts in one run, 459 traceback lines per
worker).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from redis import Redis

from statemachine import Aborted, RolloutRequest, Status
from store.client import RolloutClient
from store.queue import rollout_queue
from store.redis_server import RedisServer
from tests.unwritable import conditions, oom_hold, refusing
from tests.workers.helpers import (
    SYNTHETIC,
    direct_greedy,
    greedy,
    random_prompts,
    start_worker,
    stop,
    until,
)
from tests.workers.test_metrics_and_logs import log_lines, metrics_port, scrape

pytestmark = [pytest.mark.redis_server, pytest.mark.slow]

N = 1000  # tokens per rollout: 5 s at the test pace (200 tokens/s)
ROLLOUTS = 12  # two workers x 3 slots: two waves
HOLD_S = 6.5  # past the lease TTL (5 s): every lease lapses while no write is accepted
# Out of memory is reached by the run's own writes past a limit set just above what is used;
# if they take longer than this to cross it, the limit is lowered under what is used, so that
# the condition comes mid-generation on every machine (asserted).
CROSS_S = 2.0
LOGS = ("--metrics-port", "0", "--log-format", "json")


def status_json(url: str) -> dict[str, Any]:
    """``rollouts status --json``, the operator's command, as a process of its own."""
    out = subprocess.run(
        [sys.executable, "-m", "workers.cli", "status", "--redis", url, "--json"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    if out.returncode != 0:  # asserted by the caller, after the rollouts' own checks
        return {"exit": out.returncode, "stderr": out.stderr}
    return json.loads(out.stdout)  # type: ignore[no-any-return]


async def gauge(port: int, refusal: str) -> float | None:
    return (await scrape(port))("rollouts_worker_store_unwritable", reason=refusal)


@pytest.mark.parametrize("refusal", ["oom", "misconf"])
async def test_redis_refusing_writes_mid_run_costs_nothing(
    server: RedisServer, sync: Redis, tmp_path: Path, refusal: str
) -> None:
    client = RolloutClient(server.url)
    ps = random_prompts(ROLLOUTS, seed=28)
    ids = await client.submit([RolloutRequest(prompt_token_ids=p, sampling=greedy(N)) for p in ps])
    logs = {name: tmp_path / f"{name}.log" for name in ("a", "b")}
    workers = [
        start_worker(server.url, SYNTHETIC, name, path, *LOGS, concurrency=3)
        for name, path in logs.items()
    ]
    try:
        ports = {name: await metrics_port(path) for name, path in logs.items()}

        async def generating() -> bool:
            stats = await client.stats()
            return stats.by_state[Status.GENERATING] >= 4 and stats.tokens >= 200

        await until(generating, 60, "the workers never got going")
        seen = await _hold(server, sync, refusal, ports, tmp_path, client)
        results = await client.wait(ids, timeout=240)
        seen["gauges_after"] = {
            name: await _eventually(lambda p=port: gauge(p, refusal), 0.0, 10)
            for name, port in ports.items()
        }
        seen["status_after"] = await asyncio.to_thread(status_json, server.url)
    finally:
        stop(*workers)
    # The condition came mid-generation: both workers' rollouts were generating, most tokens
    # still to come.
    at = seen["at_refusal"]
    assert at.by_state[Status.GENERATING] >= 4 and at.tokens < ROLLOUTS * N // 2, at
    # Every rollout as an uninterrupted run, nothing charged to any budget.
    reference = await direct_greedy(None, SYNTHETIC, ps, greedy(N))
    for rid, r, (ref, _) in zip(ids, results, reference, strict=True):
        assert r.status is Status.DONE, (rid, r.status, r.error)
        np.testing.assert_array_equal(r.response_token_ids, ref)
        assert await client.store.load(rid) == await client.store.replay(rid)
    logged = [e for rid in ids for e in await client.store.events(rid)]
    aborts = Counter(e.reason.value for e in logged if isinstance(e, Aborted))
    assert aborts["worker_lost"] == 0 and aborts["engine_error"] == 0, aborts
    assert rollout_queue(sync).failed_job_registry.count == 0
    await client.aclose()
    # One episode in each worker's log: its start and its end, and no traceback.
    for name, path in logs.items():
        lines = log_lines(path)
        events = Counter(line.get("event") for line in lines)
        assert events["store_unwritable"] == 1 and events["store_writable"] == 1, (name, events)
        [start] = [line for line in lines if line.get("event") == "store_unwritable"]
        assert start["refusal"] == refusal
        tracebacks = [line["msg"] for line in lines if "exc" in line]
        assert tracebacks == [], (name, tracebacks[:3])
    # Shown while it held, and cleared after.
    assert seen["gauges"] == {"a": 1.0, "b": 1.0}, seen["gauges"]
    assert seen["gauges_after"] == {"a": 0.0, "b": 0.0}, seen["gauges_after"]
    store = seen["status"].get("store")
    assert store is not None, seen["status"]
    assert store["writable"] is False and store["refusal"] == refusal, store
    assert seen["refusing_after_status"], "rollouts status must write nothing, not lift it"
    assert seen["status_after"].get("store") == {"writable": True, "refusal": None, "message": None}


async def _hold(
    server: RedisServer,
    sync: Redis,
    refusal: str,
    ports: dict[str, int],
    tmp_path: Path,
    client: RolloutClient,
) -> dict[str, Any]:
    """The condition on, held ``HOLD_S`` from its first refusal, then lifted (in any case:
    a server left refusing could not even shut down, it saves on the way). Returns what the
    workers' gauges and ``rollouts status`` showed while it held."""
    set_on, set_off = conditions(tmp_path)[refusal]
    seen: dict[str, Any] = {}
    loop = asyncio.get_running_loop()
    try:
        await asyncio.to_thread(set_on, sync, server)
        crossed = loop.time() + CROSS_S
        while not await asyncio.to_thread(refusing, sync):
            if refusal == "oom" and loop.time() > crossed:
                await asyncio.to_thread(oom_hold, sync)
            assert loop.time() < crossed + 30, "Redis never refused writes"
            await asyncio.sleep(0.02)
        held_from = loop.time()
        seen["at_refusal"] = await client.stats()  # a script that only reads: answered
        if refusal == "oom":
            # Held, not left to hover at the limit: a client buffer freed could let one write
            # through, and this test is about one episode (``maxmemory`` below what is used
            # refuses as before; nothing is evicted under ``noeviction``).
            await asyncio.to_thread(oom_hold, sync)
        # Each worker sees the condition at its next write (a heartbeat at the latest).
        seen["gauges"] = {
            name: await _eventually(lambda p=port: gauge(p, refusal), 1.0, 10)
            for name, port in ports.items()
        }
        seen["status"] = await asyncio.to_thread(status_json, server.url)
        seen["refusing_after_status"] = await asyncio.to_thread(refusing, sync)
        await asyncio.sleep(max(0.0, HOLD_S - (loop.time() - held_from)))
        assert await asyncio.to_thread(refusing, sync), "the condition did not hold"
    finally:
        await asyncio.to_thread(set_off, sync, server)
    await until(lambda: _not(asyncio.to_thread(refusing, sync)), 30, "still refusing")
    return seen


async def _eventually(read: Callable[[], Any], expected: float, timeout: float) -> Any:
    """What ``read()`` returns once it is ``expected``, or its last value after ``timeout``
    s (asserted by the caller, after the rollouts' own checks)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = await read()
        if value == expected or asyncio.get_running_loop().time() > deadline:
            return value
        await asyncio.sleep(0.1)


async def _not(value: Any) -> bool:
    return not await value
