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
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from watch import Died, Watch

from statemachine import Finished, RolloutRequest, SamplingParams
from store import defaults
from store.client import RolloutClient
from workers.engines.base import Engine, EngineRequest, Step, StepEngine, join_chunks
from workers.outcomes import Stats
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


async def direct_steps(
    engine: StepEngine, reqs: list[RolloutRequest], concurrency: int
) -> tuple[float, list[np.ndarray], float]:
    """(seconds, token ids per request, CPU seconds of this process): the engine alone through
    its whole steps (``StepEngine``, the interface the worker's stepper uses), at most
    `concurrency` in flight, the next request added as one ends. The steps are kept as they
    come and sorted per request only after the clock stops: the engine's side does no
    per-token work beyond the engine's own."""
    t = f"{time.monotonic_ns()}"
    todo = list(enumerate(reqs))[::-1]
    kept: list[Step] = []

    async def add_next() -> None:
        i, req = todo.pop()
        await engine.add(
            EngineRequest(
                request_id=f"direct-{t}-{i}",
                prompt_token_ids=req.prompt_token_ids,
                sampling=req.sampling,
            )
        )

    c0, t0 = _process_cpu(), time.perf_counter()
    for _ in range(min(concurrency, len(todo))):
        await add_next()
    ended = 0
    while ended < len(reqs):
        async for step in engine.steps():
            kept.append(step)
            for _ in step.ends:
                ended += 1
                if todo:
                    await add_next()
    seconds, cpu = time.perf_counter() - t0, _process_cpu() - c0
    pieces: dict[str, list[np.ndarray]] = {f"direct-{t}-{i}": [] for i in range(len(reqs))}
    for step in kept:
        counts = [1] * len(step.request_ids) if step.counts is None else step.counts.tolist()
        lo = 0
        for rid, n in zip(step.request_ids, counts, strict=True):
            pieces[rid].append(step.token_ids[lo : lo + n])
            lo += n
    return seconds, [np.concatenate(p) for p in pieces.values()], cpu


async def _direct_by_steps(engine: Engine, reqs: list[RolloutRequest], concurrency: int) -> tuple:
    assert isinstance(engine, StepEngine), f"{type(engine).__name__} has no whole steps"
    seconds, out, _ = await direct_steps(engine, reqs, concurrency)
    return seconds, out


@dataclass
class Burst:
    """One burst-mode worker's run over a set of rollouts."""

    seconds: float  # from the worker's start to the last rollout's Finished
    token_ids: list[np.ndarray]
    stats: Stats
    cpu_s: float  # CPU seconds of this process (the worker's) while the worker ran
    redis_cpu_s: float  # CPU seconds of the Redis server meanwhile (if it is local)
    round_trips: int  # the worker's group-commit round trips


async def burst(
    engine: Engine,
    url: str,
    reqs: list[RolloutRequest],
    concurrency: int,
    queue: str,
    *,
    stepped: bool | None = None,
    redis_pid: int | None = None,
) -> Burst:
    """A fresh burst-mode worker takes the rollouts; its CPU is read around its run only (the
    rollouts are submitted before, and read back after)."""
    client = RolloutClient(url, queue_name=queue)
    ids = await client.submit(reqs)
    extra = {} if stepped is None else {"stepped": stepped}
    worker = Worker(
        WorkerConfig(
            redis_url=url, queues=(queue,), max_concurrency=concurrency, burst=True, **extra
        ),
        engine,
    )
    redis_cpu = _pid_cpu(redis_pid)
    r0 = redis_cpu() if redis_cpu else 0.0
    c0 = _process_cpu()
    t0 = time.time()
    await worker.run()
    cpu = _process_cpu() - c0
    if worker.stats.engine_dead:
        raise Died(f"the engine died under the burst worker: {worker.stats.engine_dead}")
    r1 = redis_cpu() if redis_cpu else 0.0
    # The end is when the last rollout's Finished was recorded, not when burst mode noticed
    # the empty queue (that waits out one blocking-pop timeout).
    t1 = await _last_finish(client, ids)
    results = [(await client.store.load(rid)).token_ids for rid in ids]
    await client.aclose()
    trips = worker.checkpointer.round_trips if worker.checkpointer else 0
    return Burst(t1 - t0, results, worker.stats, cpu, r1 - r0, trips)


async def durable(
    engine: Engine, url: str, reqs: list[RolloutRequest], concurrency: int, queue: str
) -> tuple:
    """(seconds, token ids, worker stats): a fresh burst-mode worker takes the rollouts."""
    run = await burst(engine, url, reqs, concurrency, queue)
    return run.seconds, run.token_ids, run.stats


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
    # CPU seconds of this process from submit to the last rollout ended, before any result is
    # read back: the worker's process (with the engine's front end), beside the engine alone.
    worker_cpu: list[float] = field(default_factory=list)
    alone_cpu: list[float] = field(default_factory=list)
    # The engine alone beside a ``Burner`` taking the CPU the durable side added (this process
    # and Redis), and that share of one core, per round (``compare(cpu_matched=True)``).
    matched_s: list[float] = field(default_factory=list)
    added_share: list[float] = field(default_factory=list)
    # How long a freed engine place stood empty before the worker's next rollout took it, the
    # mean per refill, per round that had one (the durable side's refill latency; the direct
    # side's is ~0).
    refill_ms: list[float] = field(default_factory=list)

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
            # How far that median can be trusted on this machine: a 95% bootstrap interval
            # over the pairs (a noisy machine's pairs have ranged 0.74-1.27 in one run).
            "ratio_ci95": _median_ci(pairs),
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
        if self.worker_cpu:
            alone = 1e6 * statistics.median(self.alone_cpu) / tokens
            worker = 1e6 * statistics.median(self.worker_cpu) / tokens
            out["worker_cpu_us_per_token_direct"] = round(alone, 2)
            out["worker_cpu_us_per_token_durable"] = round(worker, 2)
            out["worker_added_cpu_us_per_token"] = round(worker - alone, 2)
        if self.matched_s:
            matched = [d / m for d, m in zip(self.direct_s, self.matched_s, strict=True)]
            beyond = [m / w for m, w in zip(self.matched_s, self.durable_s, strict=True)]
            out["cpu_added_share_of_a_core"] = round(statistics.median(self.added_share), 4)
            out["cpu_matched_ratio_each"] = [round(x, 3) for x in matched]
            # What the engine alone keeps of its throughput beside a process that takes the
            # CPU the durable side added: the share of the gap that is this machine's CPU.
            out["cpu_matched_ratio"] = round(statistics.median(matched), 4)
            # The durable side beside that engine alone, in the same rounds: the rest.
            out["ratio_beyond_cpu_each"] = [round(x, 3) for x in beyond]
            out["ratio_beyond_cpu"] = round(statistics.median(beyond), 4)
        if self.refill_ms:
            out["refill_ms_each"] = [round(x, 2) for x in self.refill_ms]
            out["refill_ms"] = round(statistics.median(self.refill_ms), 2)
        if self.direct_busy and statistics.median(self.direct_busy) > 0:
            out["core_busy_direct"] = round(statistics.median(self.direct_busy), 4)
            out["core_busy_durable"] = round(statistics.median(self.durable_busy), 4)
            out["core_busy_ratio"] = round(out["core_busy_durable"] / out["core_busy_direct"], 4)
        return out


async def compare(
    engine: Engine,
    url: str,
    reqs: list[RolloutRequest],
    concurrency: int,
    rounds: int,
    *,
    stepped: bool | None = None,
    cpu_matched: bool = False,
    redis_pid: int | None = None,
    prefetch_tokens: int = defaults.PREFETCH_TOKENS,
    direct_steps_side: bool = False,
) -> Comparison:
    """`rounds` pairs of (direct, durable) on one engine; durable tokens must equal direct's.
    ``stepped``: how the worker consumes the engine (``WorkerConfig.stepped``);
    ``prefetch_tokens``: when it takes its next job (``WorkerConfig.prefetch_tokens``).

    ``cpu_matched``: each round also runs the engine alone beside a ``Burner`` that keeps busy
    the share of one core the durable side added in the rounds so far (this process's CPU
    beyond the direct side's, plus Redis's, from ``redis_pid``). On a machine whose cores the
    engine already fills, that CPU slows the engine whoever spends it; what the engine alone
    loses beside the burner is that part of the gap (``cpu_matched_ratio``).

    ``direct_steps_side``: the engine alone through its whole steps (``direct_steps``, the
    worker's own interface), not one ``generate`` stream per request (``direct``)."""
    alone = _direct_by_steps if direct_steps_side else direct
    queue = "side-by-side"
    worker = Worker(
        WorkerConfig(
            redis_url=url,
            queues=(queue,),
            max_concurrency=concurrency,
            stepped=stepped,
            prefetch_tokens=prefetch_tokens,
        ),
        engine,
    )
    running = asyncio.create_task(worker.run())
    client = RolloutClient(url, queue_name=queue)
    cpu = _core_cpu(engine)
    redis_cpu = _pid_cpu(redis_pid)
    result = Comparison()
    try:
        async with Watch() as watch:
            watch.task(running, "the side-by-side worker")
            for r in range(rounds):
                order = ("direct", "durable") if r % 4 in (0, 3) else ("durable", "direct")
                if cpu_matched:
                    # Beside the durable side, on the direct side's other flank: round 0 measures
                    # the share it then matches.
                    order = (*order, "matched") if order[0] == "direct" else ("matched", *order)
                for side in order:
                    c0 = cpu() if cpu else 0.0
                    p0 = _process_cpu()
                    if side == "matched":
                        with Burner(statistics.median(result.added_share)):
                            seconds, _ = await alone(engine, reqs, concurrency)
                        result.matched_s.append(seconds)
                        continue
                    if side == "direct":
                        seconds, ref = await alone(engine, reqs, concurrency)
                        result.direct_cpu.append(_process_cpu() - p0)
                        result.alone_cpu.append(result.direct_cpu[-1])
                    else:
                        seconds, got = await _durable_side(worker, client, reqs, result, redis_cpu)
                        result.durable_cpu.append(_process_cpu() - p0)  # the client's reads too
                    (result.direct_s if side == "direct" else result.durable_s).append(seconds)
                    if cpu:
                        busy = result.direct_busy if side == "direct" else result.durable_busy
                        busy.append((cpu() - c0) / seconds)
                assert all(np.array_equal(a, b) for a, b in zip(ref, got, strict=True)), (
                    "durable != direct"
                )
            watch.release(running)
    finally:
        worker.request_stop()
        with contextlib.suppress(Exception):
            await running
        await client.aclose()
    return result


def _median_ci(values: list[float], draws: int = 2000) -> list[float]:
    """95% bootstrap interval of the median of ``values`` (seeded: a run reports it alike)."""
    rng = np.random.default_rng(0)
    samples = rng.choice(np.asarray(values), size=(draws, len(values)), replace=True)
    lo, hi = np.percentile(np.median(samples, axis=1), [2.5, 97.5])
    return [round(float(lo), 4), round(float(hi), 4)]


async def _durable_side(
    worker: Worker,
    client: RolloutClient,
    reqs: list[RolloutRequest],
    result: Comparison,
    redis_cpu: Callable[[], float] | None,
) -> tuple[float, list[np.ndarray]]:
    """One durable side of ``compare``: (seconds from submit to the last Finished, tokens)."""
    stats, checkpointer = worker.stats, worker.checkpointer
    assert checkpointer is not None
    before, trips = stats.checkpoints, checkpointer.round_trips
    places = worker.places
    places.forget()  # freed at the end of the last round: nothing was waiting for them
    refills, refill_s = places.refills, places.refill_s
    t0 = time.time()
    r0 = redis_cpu() if redis_cpu else 0.0
    ids = await client.submit(reqs)
    w0 = _process_cpu()
    await _until_ended(stats, sum(stats.ended.values()) + len(reqs))
    result.worker_cpu.append(_process_cpu() - w0)  # no reading back yet
    redis_s = (redis_cpu() if redis_cpu else 0.0) - r0
    got = [r.response_token_ids for r in await client.wait(ids)]
    seconds = await _last_finish(client, ids) - t0
    if result.alone_cpu:
        added = result.worker_cpu[-1] - statistics.median(result.alone_cpu)
        result.added_share.append(max(0.0, added + redis_s) / seconds)
    result.checkpoints.append(stats.checkpoints - before)
    result.round_trips.append(checkpointer.round_trips - trips)
    if places.refills > refills:
        result.refill_ms.append(1e3 * (places.refill_s - refill_s) / (places.refills - refills))
    return seconds, got


class Burner:
    """A process that keeps ``share`` of one core busy, in slices of a few ms, while in use."""

    _CODE = (
        "import sys, time\n"
        "share, period = float(sys.argv[1]), 0.01\n"
        "while True:\n"
        "    t = time.perf_counter()\n"
        "    while time.perf_counter() - t < share * period:\n"
        "        pass\n"
        "    time.sleep(period * (1 - share))\n"
    )

    def __init__(self, share: float) -> None:
        self.share = min(max(share, 0.0), 1.0)
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Burner:
        self._proc = subprocess.Popen([sys.executable, "-c", self._CODE, str(self.share)])
        return self

    def __exit__(self, *_: object) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()


async def _until_ended(stats: Stats, ended: int) -> None:
    """Until the worker ended `ended` rollouts in all, woken by the worker's own count. A poll
    every 5 ms was ~3.5% of this process's CPU on a durable vLLM round (py-spy), counted as
    the worker's and taken from the cores the engine shares."""
    if sum(stats.ended.values()) >= ended:
        return
    done = asyncio.Event()

    def wake() -> None:
        if sum(stats.ended.values()) >= ended:
            done.set()

    counts = stats.ended
    stats.ended = _Counting(counts, wake)
    try:
        await done.wait()
    finally:
        counts.update(stats.ended)
        stats.ended = counts


class _Counting(dict[str, int]):
    """``Stats.ended`` that calls ``wake`` after each count (``Stats`` has slots: its ``end``
    cannot be wrapped on the instance)."""

    def __init__(self, counts: dict[str, int], wake: Callable[[], None]) -> None:
        super().__init__(counts)
        self._wake = wake

    def __setitem__(self, key: str, value: int) -> None:
        super().__setitem__(key, value)
        self._wake()


async def _last_finish(client: RolloutClient, ids: list[str]) -> float:
    t1 = 0.0
    for rid in ids:
        finished = [e.at for e in await client.store.events(rid) if isinstance(e, Finished)]
        if not finished:
            state = await client.store.load(rid)
            raise RuntimeError(f"rollout {rid} did not finish: {state.status.value}, {state.error}")
        t1 = max(t1, *finished)
    return t1


def _process_cpu() -> float:
    return time.process_time()  # every thread of this process, at nanosecond resolution


def _core_cpu(engine: Engine) -> Callable[[], float] | None:
    """A reader of the CPU seconds the engine's core process used so far, if it has one
    (the CPU engine's `pid`; for vLLM, every child process of this one but redis-server:
    its engine core and the workers it spawned)."""
    pid = getattr(engine, "pid", None)
    if pid is not None:
        return _pid_cpu(pid)
    import psutil  # only here: engines without a pid of their own (vLLM, which needs it)

    children = [p for p in psutil.Process().children(recursive=True) if "redis" not in p.name()]
    if not children:
        return None

    def read() -> float:
        total = 0.0
        for p in children:
            try:
                t = p.cpu_times()
            except psutil.Error:
                continue  # exited: its time is gone from the count, for both sides alike
            total += t.user + t.system
        return total

    return read


def _pid_cpu(pid: int | None) -> Callable[[], float] | None:
    """A reader of the CPU seconds process `pid` used so far (None: no such process)."""
    path = f"/proc/{pid}/stat"
    if pid is None or not os.path.exists(path):
        return None
    ticks = os.sysconf("SC_CLK_TCK")

    def read() -> float:
        with open(path) as f:
            fields = f.read().rsplit(") ", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / ticks  # utime + stime

    return read
