"""One engine, the same rollouts, generated directly and through a resident worker, in pairs.

Shared by bench_overhead.py (CPU engine) and bench_vllm.py (vLLM). This machine's speed
drifts by up to 1.7x within a minute for identical work (measured: the CPU engine alone took
5.3 to 9.1 s for the same 2,048 tokens in 16 consecutive rounds), far more than the 2%
being measured. So the two sides run as back-to-back pairs, in alternating order (ABBA), and
the figure is the median of the per-pair ratios; the worker stays up between rounds, as it
would in production, so no round pays for starting one.

Where the engine has a core process of its own (`engine.pid`, the CPU engine), the CPU time
that process spent is read from /proc for each round: `core_busy` = core CPU seconds / wall
seconds. Equal busy fractions on both sides mean the worker never left the engine waiting,
whatever the machine's speed was doing at the time.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from statemachine import Finished, RolloutRequest, SamplingParams
from store.client import RolloutClient
from workers.engines.base import Engine, EngineRequest, join_chunks
from workers.worker import Worker, WorkerConfig


def requests(n: int, max_tokens: int) -> list[RolloutRequest]:
    """`n` greedy rollouts of exactly `max_tokens` tokens, distinct prompts."""
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [
        RolloutRequest(
            prompt_token_ids=tuple(int(t) for t in (np.arange(6) * 7 + 13 * i) % 2000),
            sampling=sampling,
        )
        for i in range(n)
    ]


async def direct(engine: Engine, reqs: list[RolloutRequest], concurrency: int) -> tuple:
    """(seconds, token ids per request): the engine alone, at most `concurrency` in flight."""
    slots = asyncio.Semaphore(concurrency)

    async def one(i: int, req: RolloutRequest) -> np.ndarray:
        async with slots:
            chunks = [
                c
                async for c in engine.generate(
                    EngineRequest(
                        request_id=f"direct-{time.monotonic_ns()}-{i}",
                        prompt_token_ids=req.prompt_token_ids,
                        sampling=req.sampling,
                    )
                )
            ]
            return join_chunks(chunks).token_ids

    t0 = time.perf_counter()
    out = await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs)))
    return time.perf_counter() - t0, out


async def durable(
    engine: Engine, url: str, reqs: list[RolloutRequest], concurrency: int, queue: str
) -> tuple:
    """(seconds, token ids, worker stats): a fresh burst-mode worker takes the rollouts."""
    client = RolloutClient(url, queue_name=queue)
    ids = await client.submit(reqs)
    worker = Worker(
        WorkerConfig(redis_url=url, queues=(queue,), max_concurrency=concurrency, burst=True),
        engine,
    )
    t0 = time.time()
    await worker.run()
    # The end is when the last rollout's Finished was recorded, not when burst mode noticed
    # the empty queue (that waits out one blocking-pop timeout).
    t1 = await _last_finish(client, ids)
    results = [(await client.store.load(rid)).token_ids for rid in ids]
    await client.aclose()
    return t1 - t0, results, worker.stats


@dataclass
class Comparison:
    direct_s: list[float] = field(default_factory=list)
    durable_s: list[float] = field(default_factory=list)
    direct_busy: list[float] = field(default_factory=list)
    durable_busy: list[float] = field(default_factory=list)
    checkpoints: list[int] = field(default_factory=list)
    round_trips: list[int] = field(default_factory=list)
    # CPU seconds of this process (worker, engine front end, client) per side and round.
    direct_cpu: list[float] = field(default_factory=list)
    durable_cpu: list[float] = field(default_factory=list)

    def figures(self, tokens: int) -> dict[str, Any]:
        pairs = [d / w for d, w in zip(self.direct_s, self.durable_s, strict=True)]
        out: dict[str, Any] = {
            "direct_s_each": [round(x, 3) for x in self.direct_s],
            "durable_s_each": [round(x, 3) for x in self.durable_s],
            "ratio_each": [round(x, 3) for x in pairs],
            "direct_tokens_per_s": round(tokens / statistics.median(self.direct_s), 1),
            "durable_tokens_per_s": round(tokens / statistics.median(self.durable_s), 1),
            # The figure: median over back-to-back pairs (durable/direct throughput).
            "ratio": round(statistics.median(pairs), 4),
            "ratio_of_medians": round(
                statistics.median(self.direct_s) / statistics.median(self.durable_s), 4
            ),
            "durable_checkpoints_each": self.checkpoints,
            "durable_round_trips_each": self.round_trips,  # all Redis appends, grouped
            # What bookkeeping costs in CPU, whatever the engine's speed did meanwhile.
            "process_cpu_ms_per_token_direct": round(
                1000 * statistics.median(self.direct_cpu) / tokens, 4
            ),
            "process_cpu_ms_per_token_durable": round(
                1000 * statistics.median(self.durable_cpu) / tokens, 4
            ),
        }
        if self.direct_busy:
            out["core_busy_direct"] = round(statistics.median(self.direct_busy), 4)
            out["core_busy_durable"] = round(statistics.median(self.durable_busy), 4)
            out["core_busy_ratio"] = round(out["core_busy_durable"] / out["core_busy_direct"], 4)
        return out


async def compare(
    engine: Engine, url: str, reqs: list[RolloutRequest], concurrency: int, rounds: int
) -> Comparison:
    """`rounds` pairs of (direct, durable) on one engine; durable tokens must equal direct's."""
    queue = "side-by-side"
    worker = Worker(
        WorkerConfig(redis_url=url, queues=(queue,), max_concurrency=concurrency), engine
    )
    stats = worker.stats
    running = asyncio.create_task(worker.run())
    client = RolloutClient(url, queue_name=queue)
    cpu = _core_cpu(engine)
    result = Comparison()
    try:
        for r in range(rounds):
            order = ("direct", "durable") if r % 4 in (0, 3) else ("durable", "direct")
            for side in order:
                c0 = cpu() if cpu else 0.0
                p0 = _process_cpu()
                if side == "direct":
                    seconds, ref = await direct(engine, reqs, concurrency)
                    result.direct_cpu.append(_process_cpu() - p0)
                else:
                    before = stats.checkpoints
                    trips = worker.checkpointer.round_trips if worker.checkpointer else 0
                    t0 = time.time()
                    ids = await client.submit(reqs)
                    got = [r.response_token_ids for r in await client.wait(ids)]
                    result.durable_cpu.append(_process_cpu() - p0)  # the client's reads too
                    seconds = await _last_finish(client, ids) - t0
                    result.checkpoints.append(stats.checkpoints - before)
                    assert worker.checkpointer is not None
                    result.round_trips.append(worker.checkpointer.round_trips - trips)
                (result.direct_s if side == "direct" else result.durable_s).append(seconds)
                if cpu:
                    busy = (cpu() - c0) / seconds
                    (result.direct_busy if side == "direct" else result.durable_busy).append(busy)
            assert all(np.array_equal(a, b) for a, b in zip(ref, got, strict=True)), (
                "durable != direct"
            )
    finally:
        worker.request_stop()
        with contextlib.suppress(Exception):
            await running
        await client.aclose()
    return result


async def _last_finish(client: RolloutClient, ids: list[str]) -> float:
    t1 = 0.0
    for rid in ids:
        events = await client.store.events(rid)
        t1 = max(t1, *(e.at for e in events if isinstance(e, Finished)))
    return t1


def _process_cpu() -> float:
    t = os.times()
    return t.user + t.system


def _core_cpu(engine: Engine) -> Callable[[], float] | None:
    """A reader of the CPU seconds the engine's core process used so far, if it has one."""
    pid = getattr(engine, "pid", None)
    path = f"/proc/{pid}/stat"
    if pid is None or not os.path.exists(path):
        return None
    ticks = os.sysconf("SC_CLK_TCK")

    def read() -> float:
        with open(path) as f:
            fields = f.read().rsplit(") ", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / ticks  # utime + stime

    return read
