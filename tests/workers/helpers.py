"""Worker subprocesses and direct-engine references for the worker tests."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import numpy as np
import redis.asyncio as aredis
from redis.exceptions import OutOfMemoryError

from statemachine import Aborted, Event, Failed, Finished, Resumed, SamplingParams, Started
from tests.engine_pool import EnginePool
from workers.engine_factory import SYNTHETIC_ARGS_ENV
from workers.engines.base import EngineRequest, join_chunks
from workers.engines.synthetic import SyntheticEngine
from workers.worker_cli import command

# The synthetic engine of worker processes (`model=None`): one token per chunk like the CPU
# engine, paced at 200 tokens/s per rollout, so that a test can kill or stop a worker
# mid-generation (unpaced, 96 tokens are done before the test's first poll).
SYNTHETIC_PACE = {"tokens_per_chunk": 1, "token_delay_s": 0.005}
SYNTHETIC = None  # the `model` of start_worker and direct_greedy that means the synthetic engine


def start_worker(
    url: str,
    model: Path | None,
    name: str,
    log: Path,
    *extra: str,
    concurrency: int = 2,
    synthetic: dict[str, object] | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """A worker process on the CPU engine and ``model``, or with ``model`` None on the synthetic
    engine (``SYNTHETIC_PACE`` updated with ``synthetic``): checkpoints every 8 tokens. ``env``:
    variables added to its environment (e.g. libfaketime's)."""
    engine = "cpu" if model is not None else "synthetic"
    cmd = command(
        url, model or "", name, "--checkpoint-tokens", "8", *extra,
        concurrency=concurrency, engine=engine,
    )  # fmt: skip
    pace = json.dumps({**SYNTHETIC_PACE, **(synthetic or {})})
    full = {**os.environ, SYNTHETIC_ARGS_ENV: pace, **(env or {})}
    return subprocess.Popen(cmd, env=full, stdout=log.open("ab"), stderr=subprocess.STDOUT)


async def until(
    cond: Callable[[], Awaitable[bool]],
    timeout: float = 120,
    what: str = "timed out",
    every: float = 0.02,
) -> None:
    """Poll ``cond`` every ``every`` s until it holds; fail with ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not await cond():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(every)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def random_prompts(n: int, seed: int = 0, length: int = 6) -> list[tuple[int, ...]]:
    rng = np.random.default_rng(seed)
    return [tuple(int(t) for t in rng.integers(10, 2000, length)) for _ in range(n)]


def stop(*procs: subprocess.Popen[bytes]) -> None:
    """SIGTERM (after SIGCONT, in case a test stopped it) and wait; SIGKILL if it hangs."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.terminate()
    for p in procs:
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


def attempt_intervals(events_by_rollout: dict[str, list[Event]]) -> dict[str, list[tuple]]:
    """worker -> [(start time, end time, rollout)] of every attempt, from the recorded events."""
    out: dict[str, list[tuple]] = defaultdict(list)
    for rid, events in events_by_rollout.items():
        open_ = None
        for e in events:
            if isinstance(e, Started | Resumed):
                open_ = (e.worker_id, e.at)
            elif isinstance(e, Finished | Aborted | Failed) and open_ is not None:
                out[open_[0]].append((open_[1], e.at, rid))
                open_ = None
    return out


def max_overlap(intervals: list[tuple]) -> int:
    points = sorted(
        [(s, 1) for s, _, _ in intervals] + [(e, -1) for _, e, _ in intervals],
        key=lambda p: (p[0], p[1]),
    )  # ends before starts at the same instant
    level = peak = 0
    for _, step in points:
        level += step
        peak = max(peak, level)
    return peak


async def direct_greedy(
    pool: EnginePool | None,
    model: Path | None,
    prompts: list[tuple[int, ...]],
    sampling: SamplingParams,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """What the same engine generates for each prompt, uninterrupted and alone: the pooled CPU
    engine on ``model``, or with ``model`` None the synthetic engine (unpaced: its output does
    not depend on its pace or chunk size)."""
    engine = SyntheticEngine() if model is None or pool is None else await pool.get(model)
    out = []
    for i, prompt in enumerate(prompts):
        chunks = [
            c
            async for c in engine.generate(
                EngineRequest(request_id=f"ref{i}", prompt_token_ids=prompt, sampling=sampling)
            )
        ]
        joined = join_chunks(chunks)
        out.append((joined.token_ids, joined.logprobs))
    return out


@contextlib.asynccontextmanager
async def out_of_memory(r: aredis.Redis) -> AsyncIterator[None]:
    """The redis-server of ``r`` out of memory inside the block (maxmemory, noeviction): every
    write that may grow memory is refused (OOM) until the block ends."""
    used = int((await r.info("memory"))["used_memory"])
    await r.config_set("maxmemory-policy", "noeviction")
    await r.config_set("maxmemory", used + 1_000_000)
    n = 0
    try:
        # A write is refused while memory is over the limit, its own query buffer counted,
        # and the refusal frees that buffer, which can bring it back under: fill, in smaller
        # writes after each refusal, until it stays over.
        size = 50_000
        while int((await r.info("memory"))["used_memory"]) <= used + 1_000_000:
            try:
                await r.set(f"filler:{n}", b"x" * size)
            except OutOfMemoryError:
                size = max(16, size // 10)
            n += 1
            assert n < 10_000, "never ran out of memory"
        # Then hold it 1 MB under what is used: a buffer freed later (a client's, the AOF's,
        # which Redis's check does not count) let one write through at the fill's edge in CI.
        await r.config_set("maxmemory", used)
        yield
    finally:
        await r.config_set("maxmemory", 0)
        if n:
            await r.delete(*[f"filler:{i}" for i in range(n)])
