"""Session affinity with a real redis-server and two real worker processes (the synthetic
engine, one slot each): a session's calls stay on the worker that served its first while it is
free, go to the other at once while it is busy or after it was killed, and session-less calls
run as before."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from redis import Redis
from rq.job import Job

from statemachine import Started
from store.client import RolloutClient
from store.keys import Keys
from store.redis_server import RedisServer
from tests import factories as f
from tests.workers.helpers import SYNTHETIC, start_worker, stop, until
from tests.workers.test_affinity import blocked

pytestmark = pytest.mark.redis_server

K = Keys()
NAMES = ("wa", "wb")


@pytest_asyncio.fixture
async def client(server: RedisServer) -> AsyncIterator[RolloutClient]:
    c = RolloutClient(server.url)
    yield c
    await c.aclose()


async def call(client: RolloutClient, session: str | None, batch: str, tokens: int = 8) -> str:
    """One call of ``session`` (a rollout of ``tokens`` tokens); its rollout id."""
    prompt = (len(batch), *(ord(c) % 97 for c in batch))
    [rid] = await client.submit([f.request(tokens, prompt)], batch_id=batch, session=session)
    return rid


async def served_by(client: RolloutClient, rid: str, timeout: float = 60) -> str:
    """The worker that started ``rid``, once it ended."""
    await client.wait([rid], timeout=timeout)
    [started] = [e for e in await client.store.events(rid) if isinstance(e, Started)]
    return started.worker_id


async def both_waiting(sync: Redis) -> None:
    await until(blocked(sync, len(NAMES)), 120, "the workers never both waited on the queue")


async def test_a_sessions_calls_stay_on_their_worker_and_never_wait_for_it(
    client: RolloutClient, server: RedisServer, sync: Redis, tmp_path: Path
) -> None:
    procs = {
        n: start_worker(server.url, SYNTHETIC, n, tmp_path / f"{n}.log", concurrency=1)
        for n in NAMES
    }
    try:
        await both_waiting(sync)
        # Both free, blocked on the queue: without affinity Redis hands each call to the
        # worker blocked longest, alternating; 3 sessions of 4 calls all on one worker each
        # would be a 1-in-512 chance.
        home: dict[str, str] = {}
        for k in range(4):
            for s in ("s0", "s1", "s2"):
                worker = await served_by(client, await call(client, s, f"{s}-{k}"))
                assert home.setdefault(s, worker) == worker, (s, k, home)
                await both_waiting(sync)
        # Session-less calls carry nothing of it, and run.
        plain = [await call(client, None, f"plain-{i}") for i in range(4)]
        for rid in plain:
            await served_by(client, rid)
            job = sync.hget(K.snapshot(rid), "job").decode()  # type: ignore[union-attr]
            assert not {b"session", b"prefer"} & set(sync.hkeys(Job.key_for(job)))
        await both_waiting(sync)

        # Busy: s0's worker runs a long call of s0 (2 s at 200 tokens/s); the next call of s0
        # goes to the other worker at once, not after the long one.
        mine = home["s0"]
        other = next(n for n in NAMES if n != mine)
        long = await call(client, "s0", "s0-long", tokens=400)
        await until(_started(client, long), 30, "the long call never started")
        sent = time.monotonic()
        quick = await call(client, "s0", "s0-next")
        assert await served_by(client, quick) == other
        assert time.monotonic() - sent < 1.5
        assert await served_by(client, long) == mine
        await both_waiting(sync)

        # Killed: s1's worker SIGKILLed while free; s1's next call goes to the survivor at once.
        victim = home["s1"]
        survivor = next(n for n in NAMES if n != victim)
        procs[victim].kill()
        procs[victim].wait(10)
        sent = time.monotonic()
        after = await call(client, "s1", "s1-after")
        assert await served_by(client, after) == survivor
        assert time.monotonic() - sent < 3.0
        # Each job ran once: one start per rollout, no job left queued or started.
        assert sync.llen("rq:queue:rollouts") == 0
    finally:
        stop(*procs.values())


def _started(client: RolloutClient, rid: str):  # type: ignore[no-untyped-def]
    async def check() -> bool:
        return any(isinstance(e, Started) for e in await client.store.events(rid))

    return check
