"""The trainer API's costs next to what sits under them, measured in one run on a fresh
redis-server (AOF ``appendfsync always``, started here on a free port).

- submit: ``RolloutClient.submit`` of 10,000 rollouts (2,500 prompts of 64 token ids x n=4,
  max_tokens 1,024): checking, building the ``Submitted`` events, the existence lookups, the
  batch record, the appends and the rq jobs in scripts of ``SUBMIT_CHUNK`` (two in flight: the
  client builds a chunk while Redis records the one before). Against it, raw
  pipelined ``XADD`` of the same encoded records (from ``EventStore.prepare``, as
  ``store.batches`` gets them) to the same logs, as many per pipeline, and the same XADDs in
  MULTI/EXEC chunks (``raw_xadd_multi_per_s``: with AOF always, Redis fsyncs once per event-loop
  pass, so a plain pipeline costs an fsync per read of it and a transaction one per EXEC). The
  sides alternate for ``--rounds`` rounds (order reversed every other round, flushing between);
  the figures are medians (this machine's speed drifts by up to 2x within a minute, see
  ``side_by_side.py``).
- delivery: a synthetic-engine worker process runs 1,000 rollouts at a pace that leaves the
  cores room (8 in flight, 64 tokens each at 2 ms a token in 16-token chunks, ~50 rollouts/s;
  the cores each process used are reported); the latency of a completion is the time
  ``client.results`` yields it minus its ``Finished`` event's ``at`` (stamped by the worker just
  before the terminal append; same machine, same clock). ``delivery_push_*`` is the part after
  the append (its completion entry's id is Redis' time, to the ms).
- take=k: 32 groups of 4 whose response lengths (one per group: sampling is per prompt) are
  heavy-tailed: most ~64 tokens (log-normal, sigma 0.3), one group in 8 is 10-50x longer; 5 ms
  a token, every rollout in flight at once. Wall time from submit until every group has ended
  vs until ``groups(batch, take=k)`` yields its k-th (k = 24), alternating, medians.
- memory: Redis ``used_memory`` (after ``MEMORY PURGE``) once the 1,000 delivered rollouts are
  acknowledged vs the baseline before them (taken after a warm-up batch was acknowledged and
  the worker's rq bookkeeping settled); and, written straight through ``EventStore``, the
  memory of one in-flight token (64 rollouts holding 1,024 tokens each in checkpoints of
  ``CHECKPOINT_TOKENS``, not finished, minus the same rollouts started with none) and of one
  finished, unacknowledged 1,024-token rollout, both with 48x8 routes of 128 experts (uint8).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import redis
import redis.asyncio as aredis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from watch import Watch

from statemachine import (
    Finished,
    FinishReason,
    Membership,
    RolloutRequest,
    RolloutState,
    SamplingParams,
    commands,
)
from statemachine.commands import NewTokens
from store import EventStore, defaults, submission
from store.client import RolloutClient
from store.keys import Keys
from store.redis_server import RedisServer
from workers.engine_factory import SYNTHETIC_ARGS_ENV
from workers.engines.base import expert_dtype
from workers.worker_cli import command

ROOT = Path(__file__).resolve().parent.parent
PROMPT_TOKENS = 64
GROUP = 4
LAYERS, TOP_K, EXPERTS = 48, 8, 128  # a Qwen3-30B-A3B-like MoE: uint8 routes
DELIVERY_PACE = {"tokens_per_chunk": 16, "token_delay_s": 0.002}
DELIVERY_CONCURRENCY, DELIVERY_TOKENS = 8, 64
# 5 ms a token per rollout, every rollout of the batch in flight at once: a short group (~64
# tokens) takes ~0.3 s, the longest (~3,000) ~15 s.
TAIL_PACE = {"tokens_per_chunk": 16, "token_delay_s": 0.005}


def requests(n: int, max_tokens: int | list[int], seed: int = 0) -> list[RolloutRequest]:
    rng = np.random.default_rng(seed)
    budgets = max_tokens if isinstance(max_tokens, list) else [max_tokens] * n
    return [
        RolloutRequest(
            prompt_token_ids=tuple(int(t) for t in rng.integers(10, 30_000, PROMPT_TOKENS)),
            sampling=SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True),
        )
        for m in budgets
    ]


async def used_memory(r: aredis.Redis) -> int:
    """``used_memory`` after a full SCAN (it deletes keys whose TTL passed but which Redis'
    expiry cycle had not reclaimed yet, e.g. rq's execution records) and ``MEMORY PURGE``."""
    async for _ in r.scan_iter(count=1000):
        pass
    await r.memory_purge()
    return int((await r.info("memory"))["used_memory"])


async def clients_memory(r: aredis.Redis) -> int:
    """The connections' buffers, part of ``used_memory``: they swing by ~100-250 KB with
    what the connections last did, which is most of this figure's noise on a ~2 MB base."""
    return int((await r.info("memory"))["mem_clients_normal"])


async def until(cond: Callable[[], Awaitable[bool]], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await cond():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        await asyncio.sleep(0.05)


# -- submit ---------------------------------------------------------------------------------
async def bench_submit(url: str, prompts: int, rounds: int) -> dict[str, Any]:
    reqs = requests(prompts, 1024)
    client = RolloutClient(url)
    sync = redis.Redis.from_url(url)
    # The records the raw side writes: built as store.batches builds them, before the clock.
    prepare = functools.partial(client.store.prepare, None)
    s = submission.build(reqs, n=GROUP, batch_id="raw", queue=defaults.QUEUE_NAME,
                         admitted_version=0, at=time.time())  # fmt: skip
    records = [(p.keys[0], bytes(p.args[2])) for p in map(prepare, s.events)]  # type: ignore[arg-type]
    chunk = defaults.SUBMIT_CHUNK

    def raw(transaction: bool) -> float:
        t0 = time.perf_counter()
        for start in range(0, len(records), chunk):
            with sync.pipeline(transaction=transaction) as pipe:
                for key, record in records[start : start + chunk]:
                    pipe.xadd(key, {"e": record}, id="0-1")
                pipe.execute()
        return time.perf_counter() - t0

    async def via_client(r: int) -> float:
        t0 = time.perf_counter()
        batch = await client.submit(reqs, n=GROUP, batch_id=f"submit-{r}")
        elapsed = time.perf_counter() - t0
        assert len(batch) == len(records)
        return elapsed

    times: dict[str, list[float]] = {"raw": [], "multi": [], "submit": []}
    try:
        for r in range(rounds):
            order = ("raw", "multi", "submit") if r % 2 == 0 else ("submit", "multi", "raw")
            for side in order:
                if side == "submit":
                    times[side].append(await via_client(r))
                else:
                    times[side].append(raw(transaction=side == "multi"))
                sync.flushall()
    finally:
        await client.aclose()
        sync.close()
    n = len(records)
    raw_s, multi_s, submit_s = (statistics.median(times[k]) for k in ("raw", "multi", "submit"))
    return {
        "submit_rollouts": n,
        "submit_record_bytes": round(statistics.mean(len(rec) for _, rec in records), 1),
        "submit_rollouts_per_s": round(n / submit_s, 1),
        "raw_xadd_per_s": round(n / raw_s, 1),
        "submit_ratio": round(raw_s / submit_s, 4),
        "submit_ratio_each": [round(a / b, 4) for a, b in zip(times["raw"], times["submit"])],
        # The same XADDs in MULTI/EXEC chunks, as submit sends its appends: with appendfsync
        # always, Redis fsyncs once per event-loop pass, so a plain pipeline that arrives in
        # many reads costs many fsyncs and a transaction (applied at EXEC) one.
        "raw_xadd_multi_per_s": round(n / multi_s, 1),
        "submit_ratio_vs_multi": round(multi_s / submit_s, 4),
    }


# -- worker processes -------------------------------------------------------------------------
class WorkerProcess:
    """A ``rollouts worker --engine synthetic`` process of this run."""

    def __init__(
        self, url: str, name: str, log_dir: Path, concurrency: int, pace: dict[str, Any],
        watch: Watch,
    ) -> None:  # fmt: skip
        self.log = log_dir / f"{name}.log"
        cmd = command(url, "", name, concurrency=concurrency, engine="synthetic")
        env = {**os.environ, SYNTHETIC_ARGS_ENV: json.dumps(pace)}
        self._out = self.log.open("ab")
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=self._out, stderr=subprocess.STDOUT
        )
        self.watch = watch
        watch.process(self.proc, f"worker {name}", self.log)

    def cpu_s(self) -> float:
        return process_cpu_s(self.proc.pid)

    def stop(self) -> None:
        self.watch.release(self.proc)
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self._out.close()

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


def process_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(") ", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


async def settle(r: aredis.Redis, queue: str) -> None:
    """Until the worker's rq bookkeeping of its last jobs is done (it runs just after each
    rollout ended, so a trainer that acks at once is ahead of it) and its execution records
    expired (one rq execution TTL after each job ended)."""

    async def idle() -> bool:
        return await rq_idle(r, queue) and not await r.keys("rq:execution:*")

    await until(idle, 60, "the worker's rq bookkeeping did not settle")


async def rq_idle(r: aredis.Redis, queue: str) -> bool:
    """No job of ``queue`` started and not yet done with, in rq's registries."""
    started = await r.zcard(f"rq:wip:{queue}") + await r.zcard(f"rq:started:{queue}")
    return int(started) == 0


async def worker_up(r: aredis.Redis, keys: Keys, worker: WorkerProcess) -> None:
    async def beating() -> bool:
        if worker.proc.poll() is not None:
            raise RuntimeError(f"worker exited:\n{worker.tail()}")
        return bool(await r.hlen(keys.workers()))  # type: ignore[misc]

    await until(beating, 60, "the worker did not start")


# -- delivery and memory after ack ------------------------------------------------------------
async def bench_delivery(url: str, log_dir: Path, prompts: int, watch: Watch) -> dict[str, Any]:
    r = aredis.Redis.from_url(url)
    client = RolloutClient(url)
    pace = DELIVERY_PACE
    worker = WorkerProcess(url, "delivery", log_dir, DELIVERY_CONCURRENCY, pace, watch)
    try:
        await worker_up(r, client.keys, worker)
        # A first batch creates what stays for good (counters, rq's queue set, the worker).
        warm = await client.submit(requests(4, 16, seed=1), n=GROUP, batch_id="warm")
        await client.wait(list(warm), timeout=120)
        await client.ack(batch_id="warm")
        await settle(r, defaults.QUEUE_NAME)
        keys_before, memory_before = set(await r.keys("*")), await used_memory(r)
        clients_before = await clients_memory(r)

        batch = await client.submit(requests(prompts, DELIVERY_TOKENS, seed=2), n=GROUP,
                                    batch_id="delivery")  # fmt: skip
        cpu0 = (worker.cpu_s(), process_cpu_s(os.getpid()), await redis_cpu_s(r))
        await watch_fsync(r)
        t0 = time.perf_counter()
        yielded: dict[str, float] = {}
        appended: dict[str, float] = {}  # Redis' clock (ms) when the terminal append ran
        async for result in client.results("delivery", timeout=600):
            yielded[result.rollout_id] = time.time()
            appended[result.rollout_id] = int(result.position.split("-")[0]) / 1000
        wall = time.perf_counter() - t0
        cpu1 = (worker.cpu_s(), process_cpu_s(os.getpid()), await redis_cpu_s(r))
        fsync_max_ms, fsync_stalls = await fsync_stalls_seen(r)
        assert sorted(yielded) == sorted(batch), "a completion was missed"
        finished = {}
        for rid in batch:
            finished[rid] = next(e.at for e in await client.store.events(rid)
                                 if isinstance(e, Finished))  # fmt: skip
        latency_ms = np.array([1000 * (yielded[rid] - finished[rid]) for rid in batch])
        # The part from the append's completion entry (its stream id is Redis' time, to the
        # ms) to the trainer: how long the push takes, apart from the worker's write.
        push_ms = np.array([1000 * (yielded[rid] - appended[rid]) for rid in batch])

        report = await client.ack(batch_id="delivery")
        assert not report.live, report
        await settle(r, defaults.QUEUE_NAME)
        # The worker's own rq keys come and go with its heartbeat (e.g. rq's registry-cleaning
        # marker): give the key set a few seconds to match, as the baseline test does.
        with contextlib.suppress(TimeoutError):
            await until(lambda: same_keys(r, keys_before), 10, "keys differ")
        keys_after, memory_after = set(await r.keys("*")), await used_memory(r)
        clients_after = await clients_memory(r)
    finally:
        worker.stop()
        await client.aclose()
        await r.aclose()
    busy = [round((b - a) / wall, 3) for a, b in zip(cpu0, cpu1)]
    p50, p99 = np.percentile(latency_ms, [50, 99])
    return {
        "delivery_completions": len(batch),
        "delivery_pace": f"{DELIVERY_CONCURRENCY} in flight x {DELIVERY_TOKENS} tokens, "
        f"{pace['tokens_per_chunk']} tokens per {pace['token_delay_s'] * 1000:g} ms/token chunk",
        "delivery_rollouts_per_s": round(len(batch) / wall, 1),
        "delivery_p50_ms": round(float(p50), 2),
        "delivery_p99_ms": round(float(p99), 2),
        "delivery_max_ms": round(float(latency_ms.max()), 2),
        "delivery_push_p50_ms": round(float(np.percentile(push_ms, 50)), 1),
        "delivery_push_p99_ms": round(float(np.percentile(push_ms, 99)), 1),
        # Redis' own latency monitor: the slowest AOF fsync (a completion's reply waits for
        # it) and the seconds in which one took over FSYNC_STALL_MS (disk shared with others).
        "delivery_fsync_max_ms": fsync_max_ms,
        "delivery_fsync_stall_seconds": fsync_stalls,
        # Cores busy during the run (1.0 = one core): the worker, this trainer, redis-server.
        "delivery_cpu_worker": busy[0],
        "delivery_cpu_trainer": busy[1],
        "delivery_cpu_redis": busy[2],
        "memory_before_bytes": memory_before,
        "memory_after_ack_bytes": memory_after,
        "memory_after_ack_ratio": round(memory_after / memory_before, 4),
        "memory_clients_before_bytes": clients_before,
        "memory_clients_after_bytes": clients_after,
        "keys_before": len(keys_before),
        "keys_after_ack": len(keys_after),
        "keys_added_after_ack": sorted(k.decode() for k in keys_after - keys_before),
        "keys_gone_after_ack": sorted(k.decode() for k in keys_before - keys_after),
    }


FSYNC_STALL_MS = 10


async def watch_fsync(r: aredis.Redis) -> None:
    await r.config_set("latency-monitor-threshold", FSYNC_STALL_MS)
    await r.execute_command("LATENCY", "RESET")  # type: ignore[no-untyped-call]


async def fsync_stalls_seen(r: aredis.Redis) -> tuple[int, int]:
    """(slowest fsync in ms, seconds with a stall) since ``watch_fsync``; (0, 0) if none."""
    history = await r.execute_command("LATENCY", "HISTORY", "aof-fsync-always")  # type: ignore[no-untyped-call]
    await r.config_set("latency-monitor-threshold", 0)
    return max((int(ms) for _, ms in history), default=0), len(history)


async def same_keys(r: aredis.Redis, keys: set[bytes]) -> bool:
    return set(await r.keys("*")) == keys


async def redis_cpu_s(r: aredis.Redis) -> float:
    info = await r.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


# -- take=k on a long tail --------------------------------------------------------------------
def tail_lengths(groups: int, base: int, seed: int = 0) -> list[int]:
    """Most groups ~``base`` tokens; one in 8 (at least one) 10-50x longer."""
    rng = np.random.default_rng(seed)
    lengths = base * rng.lognormal(0.0, 0.3, groups)
    long = rng.choice(groups, max(1, groups // 8), replace=False)
    lengths[long] *= rng.uniform(10, 50, len(long))
    return [max(8, int(x)) for x in lengths]


async def bench_take_k(
    url: str, log_dir: Path, groups: int, base: int, rounds: int, watch: Watch
) -> dict[str, Any]:
    lengths = tail_lengths(groups, base)
    k = max(1, groups * 3 // 4)
    client = RolloutClient(url)
    r = aredis.Redis.from_url(url)
    worker = WorkerProcess(url, "tail", log_dir, groups * GROUP, TAIL_PACE, watch)
    times: dict[str, list[float]] = {"all": [], "take": []}
    try:
        await worker_up(r, client.keys, worker)
        for i in range(rounds):
            order = ("all", "take") if i % 4 in (0, 3) else ("take", "all")
            for side in order:
                batch_id = f"tail-{side}-{i}"
                t0 = time.perf_counter()
                await client.submit(requests(groups, lengths, seed=3), n=GROUP, batch_id=batch_id)
                take = k if side == "take" else None
                got = 0
                async for _ in client.groups(batch_id, take=take, timeout=300):
                    got += 1
                    if got == (k if take else groups):
                        times[side].append(time.perf_counter() - t0)
                # The cancelled tail lets go of the worker before the next round starts.
                await until(lambda: rq_idle(r, defaults.QUEUE_NAME), 60, "tail still running")
                await client.ack(batch_id=batch_id)
    finally:
        worker.stop()
        await client.aclose()
        await r.aclose()
    all_s, take_s = statistics.median(times["all"]), statistics.median(times["take"])
    return {
        "take_k_groups": groups,
        "take_k_k": k,
        "take_k_group_size": GROUP,
        "take_k_lengths": sorted(lengths),
        "take_k_pace_ms_per_token": TAIL_PACE["token_delay_s"] * 1000,
        "take_k_all_s": round(all_s, 3),
        "take_k_first_k_s": round(take_s, 3),
        "take_k_speedup": round(all_s / take_s, 2),
    }


# -- memory of tokens, written straight through the store -------------------------------------
def new_tokens(n: int, rng: np.random.Generator) -> NewTokens:
    return NewTokens(
        token_ids=rng.integers(0, 150_000, n, dtype=np.int32),
        logprobs=rng.uniform(-10, 0, n).astype(np.float32),
        weight_versions=np.full(n, 3, dtype=np.int64),
        routed_experts=rng.integers(0, EXPERTS, (n, LAYERS, TOP_K)).astype(expert_dtype(EXPERTS)),
    )


async def started(store: EventStore, prefix: str, n: int, max_tokens: int) -> list[RolloutState]:
    request = requests(1, max_tokens)[0]
    states = []
    for i in range(n):
        rid = f"{prefix}.{i}.0"
        sub = commands.submit(rid, request, membership=Membership(batch_id=prefix, group_index=i))
        s = await store.append(None, sub)
        for e in commands.begin(s, worker_id="bench", weight_version=3, weight_mode="abort",
                                model="bench"):  # fmt: skip
            s = await store.append(s, e)
        states.append(s)
    return states


async def write_tokens(
    store: EventStore, states: list[RolloutState], tokens: int, *, finish: bool
) -> list[RolloutState]:
    """``tokens`` tokens to every rollout, in checkpoints of the worker's default size, all
    rollouts' checkpoints of one flush point in one round trip (as a worker writes them)."""
    rng = np.random.default_rng(0)
    step = defaults.CHECKPOINT_TOKENS
    for offset in range(0, tokens, step):
        n = min(step, tokens - offset)
        last = finish and offset + n == tokens
        chains = []
        for s in states:
            t = new_tokens(n, rng)
            events = commands.finish(s, FinishReason.LENGTH, tokens=t) if last else [
                commands.checkpoint(s, t)]  # fmt: skip
            chains.append((s, events))
        results = await store.append_many(chains)
        states = [s for s in results if isinstance(s, RolloutState)]
        assert len(states) == len(results), results[:1]
    return states


async def bench_memory(url: str, rollouts: int, tokens: int) -> dict[str, Any]:
    r = aredis.Redis.from_url(url)
    store = EventStore(r)
    try:
        await r.flushall()
        base = await used_memory(r)
        states = await started(store, "inflight", rollouts, tokens)
        opened = await used_memory(r)
        await write_tokens(store, states, tokens, finish=False)
        held = await used_memory(r)
        await r.flushall()

        base = await used_memory(r)
        states = await started(store, "finished", rollouts, 1024)
        await write_tokens(store, states, 1024, finish=True)
        finished = await used_memory(r)
        assert (await store.load(states[0].rollout_id)).status.value == "done"
        await r.flushall()
    finally:
        await r.aclose()
    payload = 4 + 4 + 8 + LAYERS * TOP_K * np.dtype(expert_dtype(EXPERTS)).itemsize
    return {
        "memory_rollouts": rollouts,
        "memory_inflight_tokens_each": tokens,
        "payload_bytes_per_token_48x8": payload,
        "bytes_per_inflight_token": round((held - opened) / (rollouts * tokens), 1),
        "bytes_per_inflight_rollout_overhead": round((opened - base) / rollouts, 1),
        "bytes_per_finished_1k_rollout_48x8": round((finished - base) / rollouts),
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    quick = args.quick
    with (
        tempfile.TemporaryDirectory(prefix="bench-client-") as tmp,
        RedisServer(Path(tmp) / "redis") as server,
    ):
        out: dict[str, Any] = {"quick": quick}
        t0 = time.perf_counter()
        async with Watch() as watch:
            watch.redis(server)
            out |= await bench_submit(server.url, 100 if quick else 2500,
                                      2 if quick else args.rounds)  # fmt: skip
            out |= await bench_memory(server.url, 8 if quick else 64, 64 if quick else 1024)
            out |= await bench_delivery(server.url, Path(tmp), 25 if quick else 250, watch)
            out |= await bench_take_k(
                server.url, Path(tmp), 8 if quick else 32, 16 if quick else 64,
                1 if quick else args.tail_rounds, watch,
            )  # fmt: skip
        out["bench_s"] = round(time.perf_counter() - t0, 1)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6, help="alternating submit rounds per side")
    ap.add_argument("--tail-rounds", type=int, default=2, help="take=k rounds per side")
    ap.add_argument("--quick", action="store_true", help="a tiny workload (the smoke test's)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    a = ap.parse_args()
    result = asyncio.run(main(a))
    if a.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:40s} {v}")
