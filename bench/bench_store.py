"""Store append throughput and memory next to the raw Redis primitive underneath, in one run.

256 rollouts, each appending chunks of 32 tokens with logprobs, per-token weight versions and a
48-layer x top-8 uint8 routed-experts block per token. Both sides run against the same fresh
redis-server (started here on a free port), one after the other:

- store: ``EventStore.append_many`` with one chunk of every rollout per call, the way a worker
  checkpoints all its in-flight rollouts in one round trip; this includes the Python fold that
  validates each event, encoding, and the MULTI/EXEC of lua/append.lua (seq + attempt check and
  snapshot HSET for every rollout in one script call) with each record's XADD beside it;
- raw:   pipelined ``XADD`` of blobs of the same size, the same number per round trip.

Also reported: the store driven by 256 concurrent coroutines each awaiting its own appends
(``concurrent_*``), Redis memory per stored token against the payload per token, and the Redis
server's own CPU per event on both sides (``*_redis_cpu_us_per_event``, from the server's
``used_cpu_sys + used_cpu_user`` over the timed part of each round, so parsing, AOF writes and
transactions count, not just the commands), whose ratio ``redis_cpu_ratio`` (raw / store) says
how close an append's cost to Redis is to the bare XADD underneath it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import redis.asyncio as aredis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from statemachine import (
    RolloutRequest,
    RolloutState,
    SamplingParams,
    Started,
    Submitted,
    TokensAppended,
)
from store import EventStore, Keys
from store.redis_server import RedisServer

LAYERS, TOP_K, EXPERTS = 48, 8, 128


def make_chunks(rollouts: int, chunks: int, tokens: int, seed: int = 0) -> list[list[dict]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(rollouts):
        per = []
        for c in range(chunks):
            per.append(
                {
                    "offset": c * tokens,
                    "token_ids": rng.integers(0, 150_000, tokens, dtype=np.int32),
                    "logprobs": rng.uniform(-10, 0, tokens).astype(np.float32),
                    "weight_versions": np.full(tokens, 3, dtype=np.int64),
                    "routed_experts": rng.integers(
                        0, EXPERTS, (tokens, LAYERS, TOP_K), dtype=np.uint8
                    ),
                }
            )
        out.append(per)
    return out


async def used_memory(client: aredis.Redis) -> int:
    return int((await client.info("memory"))["used_memory"])


class ServerCpu:
    """The Redis server's CPU seconds (all its threads, user + system) between ``start`` and
    ``stop``."""

    def __init__(self, client: aredis.Redis) -> None:
        self.client = client
        self.seconds = 0.0

    async def _now(self) -> float:
        info = await self.client.info("cpu")
        return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])

    async def start(self) -> None:
        self.seconds = -await self._now()

    async def stop(self) -> None:
        self.seconds += await self._now()


async def start_rollouts(store: EventStore, prefix: str, n: int, max_tokens: int) -> list:
    request = RolloutRequest(
        prompt_token_ids=list(range(1, 257)), sampling=SamplingParams(max_tokens=max_tokens)
    )
    states = []
    for i in range(n):
        rid = f"{prefix}{i}"
        s = await store.append(None, Submitted(rollout_id=rid, seq=1, request=request))
        s = await store.append(
            s, Started(rollout_id=rid, seq=2, attempt=1, worker_id="bench", weight_version=3)
        )
        states.append(s)
    return states


def event(state: RolloutState, chunk: dict) -> TokensAppended:
    return TokensAppended(
        rollout_id=state.rollout_id, seq=state.seq + 1, attempt=state.attempt, **chunk
    )


def split(items: list, parts: int) -> list[list]:
    return [items[i::parts] for i in range(parts)]


def prebuilt(states: list[RolloutState], data: list[list[dict]]) -> list[list[TokensAppended]]:
    """Every chunk's event, built before the clock starts: building events is the producer's
    work (the engine's output wrapped), as building blobs is on the raw side."""
    out = []
    for s, chunks in zip(states, data):
        out.append(
            [
                TokensAppended(
                    rollout_id=s.rollout_id, seq=s.seq + 1 + c, attempt=s.attempt, **chunk
                )
                for c, chunk in enumerate(chunks)
            ]
        )
    return out


async def run_store_batched(
    store: EventStore, data: list[list[dict]], max_tokens: int, writers: int, cpu: ServerCpu
) -> float:
    states = await start_rollouts(store, "b", len(data), max_tokens)
    events = prebuilt(states, data)

    async def writer(states: list[RolloutState], events: list[list[TokensAppended]]) -> None:
        for c in range(len(events[0])):
            results = await store.append_many([(s, [e[c]]) for s, e in zip(states, events)])
            assert all(isinstance(r, RolloutState) for r in results), results[:1]
            states = results  # type: ignore[assignment]

    await cpu.start()
    t0 = time.perf_counter()
    await asyncio.gather(
        *(writer(s, e) for s, e in zip(split(states, writers), split(events, writers)))
    )
    elapsed = time.perf_counter() - t0
    await cpu.stop()
    return elapsed


async def run_store_concurrent(store: EventStore, data: list[list[dict]], max_tokens: int) -> float:
    states = await start_rollouts(store, "c", len(data), max_tokens)
    events = prebuilt(states, data)

    async def one(state: RolloutState, events: list[TokensAppended]) -> None:
        for e in events:
            state = await store.append(state, e)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(s, e) for s, e in zip(states, events)))
    return time.perf_counter() - t0


async def run_raw(
    client: aredis.Redis, data: list[list[dict]], blob_size: int, writers: int, cpu: ServerCpu
) -> float:
    keys = Keys("raw")
    blob = bytes(blob_size)

    async def writer(ids: list[int]) -> None:
        for c in range(len(data[0])):
            async with client.pipeline(transaction=False) as pipe:
                for i in ids:
                    pipe.xadd(keys.log(f"r{i}"), {"e": blob}, id=f"0-{c + 1}")
                await pipe.execute()

    await cpu.start()
    t0 = time.perf_counter()
    await asyncio.gather(*(writer(ids) for ids in split(list(range(len(data))), writers)))
    elapsed = time.perf_counter() - t0
    await cpu.stop()
    return elapsed


async def main(args: argparse.Namespace) -> dict:
    data = make_chunks(args.rollouts, args.chunks, args.tokens)
    n_events = args.rollouts * args.chunks
    n_tokens = n_events * args.tokens
    max_tokens = args.chunks * args.tokens
    first = data[0][0]
    payload = (
        sum(first[k].nbytes for k in ("token_ids", "logprobs", "weight_versions", "routed_experts"))
        / args.tokens
    )
    with RedisServer(config={"appendonly": "yes", "appendfsync": args.fsync}) as server:
        client = aredis.Redis.from_url(server.url, max_connections=args.rollouts + 8)
        store = EventStore(client)
        # Encoded record size of one chunk, so the raw side writes blobs of exactly that size.
        from statemachine import codec

        sample = await start_rollouts(store, "s", 1, max_tokens)
        blob_size = len(codec.encode(event(sample[0], first)))
        await client.flushall()

        # Alternate the two sides for several rounds on the same server and compare medians:
        # this machine's speed drifts by 2x between runs, and whichever side ran first on a
        # fresh server would otherwise look better.
        raw_times, store_times, raw_mems, store_mems = [], [], [], []
        raw_cpu, store_cpu = [], []
        for _ in range(args.rounds):
            cpu = ServerCpu(client)
            mem0 = await used_memory(client)
            raw_times.append(await run_raw(client, data, blob_size, args.writers, cpu))
            raw_cpu.append(cpu.seconds)
            raw_mems.append(await used_memory(client) - mem0)
            await client.flushall()
            mem0 = await used_memory(client)
            store_times.append(await run_store_batched(store, data, max_tokens, args.writers, cpu))
            store_cpu.append(cpu.seconds)
            store_mems.append(await used_memory(client) - mem0)
            await client.flushall()
        raw_s, store_s = statistics.median(raw_times), statistics.median(store_times)
        raw_cpu_s, store_cpu_s = statistics.median(raw_cpu), statistics.median(store_cpu)
        # Medians too: a round's reading is off by 20-25% now and then (memory freed after
        # a FLUSHALL returns shows up in whichever reading comes next).
        raw_mem, store_mem = statistics.median(raw_mems), statistics.median(store_mems)

        conc_s = await run_store_concurrent(store, data, max_tokens)
        await client.aclose()
    return {
        "rollouts": args.rollouts,
        "events": n_events,
        "tokens_per_event": args.tokens,
        "appendfsync": args.fsync,
        "writers": args.writers,
        "rounds": args.rounds,
        "store_events_per_s": round(n_events / store_s, 1),
        "store_tokens_per_s": round(n_tokens / store_s, 1),
        "raw_events_per_s": round(n_events / raw_s, 1),
        "ratio": round(raw_s / store_s, 3),
        "raw_redis_cpu_us_per_event": round(raw_cpu_s / n_events * 1e6, 2),
        "store_redis_cpu_us_per_event": round(store_cpu_s / n_events * 1e6, 2),
        "redis_cpu_ratio": round(raw_cpu_s / store_cpu_s, 3),
        "concurrent_store_events_per_s": round(n_events / conc_s, 1),
        "concurrent_ratio": round(raw_s / conc_s, 3),
        "record_bytes_per_event": blob_size,
        "payload_bytes_per_token": round(payload, 1),
        "redis_bytes_per_token": round(store_mem / n_tokens, 1),
        "raw_redis_bytes_per_token": round(raw_mem / n_tokens, 1),
        "memory_ratio": round(store_mem / n_tokens / payload, 3),
    }


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rollouts", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=16, help="chunks appended per rollout")
    ap.add_argument("--tokens", type=int, default=32, help="tokens per chunk")
    ap.add_argument(
        "--writers",
        type=int,
        default=4,
        help="concurrent batched writers, like worker processes sharing one Redis",
    )
    ap.add_argument(
        "--rounds", type=int, default=9,
        help="alternating rounds per side (a round is ~0.5 s; the machine drifts more than that)",
    )  # fmt: skip
    ap.add_argument("--fsync", default="everysec", choices=["always", "everysec", "no"])
    ap.add_argument("--quick", action="store_true", help="a tiny workload (the smoke test's)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    a = ap.parse_args()
    if a.quick:
        a.rollouts, a.chunks, a.rounds = 16, 4, 1
    result = asyncio.run(main(a))
    if a.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:32s} {v}")
