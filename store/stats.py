"""What a trainer or an operator sees of the whole deployment, without scanning a key.

Rollouts by state are counters kept by the append script itself (``lua/append.lua``), in the
same atomic step as each transition, so they never drift from the logs: states that have not
ended (pending, generating, aborted, resumed, and an episode's awaiting_tool, running_tool and
next_turn) count the rollouts in them now; terminal states count every rollout that ever ended
so. Workers publish a heartbeat (``beat``) with their in-flight count and weight version; queue
depths are rq's lists. ``read_stats`` gets all of it in one round trip; with the queue on a
Redis of its own (``store.queue_redis``), the depths are read there, beside the store's read
(two reads, not one instant: this is display data). On Redis Cluster the counters are kept
per slot and summed (``store.slot_counters``), read beside the heartbeats and the depths.

A heartbeat's age is judged by Redis's clock, never by a host's: a worker stamps its beat with
the time its lease renewal read from Redis (``Leases.renew``), and readers compare it with
Redis's clock read with the stats (``Stats.now``). Hosts whose clocks disagree by more than
``WORKER_STALE_S`` would otherwise drop live workers from the stats, or keep dead ones.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from rq import Queue

from statemachine import Status
from store import scripts
from store.keys import Keys
from store.pause import Pause
from store.slot_counters import summed

# stats.lua's rq prefix that reads no rq key.
RQ_NONE = ""
# A worker whose last heartbeat is older than this is not counted as live (it beats every
# HEARTBEAT_S; a dead one's entry is removed by the next reaper pass, see ``prune``).
WORKER_STALE_S = 15.0


@dataclass(frozen=True, slots=True)
class WorkerBeat:
    worker_id: str
    in_flight: int
    weight_version: int | None
    queues: tuple[str, ...]
    model: str
    at: float = field(default_factory=time.time)  # unix s; the worker gives Redis's clock
    # The deployment pause this worker holds (its ``Pause.at``), None while it admits: with
    # ``in_flight`` 0 it says nothing runs there until /resume (``/pause?mode=wait``).
    paused: float | None = None

    def encode(self) -> bytes:
        packed: bytes = msgpack.packb(
            [self.in_flight, self.weight_version, list(self.queues), self.model, self.at,
             self.paused],
            use_bin_type=True,
        )  # fmt: skip
        return packed

    @classmethod
    def decode(cls, worker_id: str, raw: bytes) -> WorkerBeat:
        # Five fields: a worker older than the pause (it never holds one).
        in_flight, version, queues, model, at, *paused = msgpack.unpackb(raw)
        return cls(worker_id, in_flight, version, tuple(queues), model, at, *paused[:1])

    def age_s(self, now: float) -> float:
        """``now``: Redis's clock (``Stats.now``), as the worker stamps ``at``."""
        return now - self.at


@dataclass(frozen=True, slots=True)
class Stats:
    by_state: dict[Status, int]  # live states: now; terminal states: ever
    tokens: int  # tokens ever appended (regenerated ones after a crash are counted again)
    queues: dict[str, int]  # rq queue -> jobs waiting
    workers: list[WorkerBeat]  # live ones (heartbeat younger than WORKER_STALE_S)
    now: float  # Redis's clock when read (unix s): what the heartbeats' ages are measured by

    @property
    def in_flight(self) -> int:
        return sum(self.by_state[s] for s in (Status.GENERATING, Status.RESUMED))


async def beat(redis: Redis, keys: Keys, heartbeat: WorkerBeat) -> Pause | None:
    """The worker's line written, and the deployment's pause read, in one round trip: every
    worker sees a ``/pause`` or ``/resume`` within one heartbeat, for no extra round trip."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.hset(keys.workers(), heartbeat.worker_id, heartbeat.encode())  # type: ignore[arg-type]
        pipe.hgetall(keys.paused())
        _, paused = await pipe.execute()
    return Pause.decode(paused)


async def remove(redis: Redis, keys: Keys, worker_id: str) -> None:
    await redis.hdel(keys.workers(), worker_id)  # type: ignore[misc]


async def read_stats(redis: Redis, keys: Keys, queue: Redis | None = None) -> Stats:
    """``queue``: the queue's Redis, when it is not the store's (``redis``)."""
    if isinstance(redis, RedisCluster):  # counters per slot; the queue is always apart there
        total, (_, beats, _, now_ms), queues = await asyncio.gather(
            summed(redis, keys), _workers(redis, keys), _depths(queue) if queue else _none()
        )
        counters = [x for field, n in total.items() for x in (field, n)]
    elif queue is None:
        counters, beats, queues, now_ms = await _read(redis, keys)
    else:
        (counters, beats, _, now_ms), queues = await asyncio.gather(
            _read(redis, keys, RQ_NONE), _depths(queue)
        )
    values = _pairs(counters)
    by_state = {s: int(values.get(s.value, 0)) for s in Status}
    now = int(now_ms) / 1000
    workers = [WorkerBeat.decode(k.decode(), v) for k, v in _pairs_raw(beats)]
    return Stats(
        by_state=by_state,
        tokens=int(values.get("tokens", 0)),
        queues={k: int(v) for k, v in _pairs(queues).items()},
        workers=sorted(
            (w for w in workers if w.age_s(now) <= WORKER_STALE_S), key=lambda w: w.worker_id
        ),
        now=now,
    )


async def prune(redis: Redis, keys: Keys, older_than_s: float = WORKER_STALE_S) -> list[str]:
    """Drop the heartbeats of workers gone quiet (killed ones never remove their own)."""
    # One round trip every ~10 s; no counters, no queue read (none is needed: the queue may be
    # elsewhere, the counters are per slot on a cluster).
    _, beats, _, now_ms = await _workers(redis, keys)
    now = int(now_ms) / 1000
    stale = [
        k.decode()
        for k, v in _pairs_raw(beats)
        if WorkerBeat.decode(k.decode(), v).age_s(now) > older_than_s
    ]
    if stale:
        await redis.hdel(keys.workers(), *stale)  # type: ignore[misc]
    return stale


async def _read(redis: Redis, keys: Keys, rq_prefix: str = "rq:") -> list[Any]:
    """Counters, heartbeats, queue depths and Redis's clock (ms), in one round trip; no
    depths (an empty list) with ``rq_prefix`` ``RQ_NONE``."""
    return list(await scripts.STATS(redis, [keys.stats(), keys.workers()], [rq_prefix]))


async def _workers(redis: Redis, keys: Keys) -> list[Any]:
    """``_read`` of the heartbeats alone (stats.lua's one-key form: one slot, on a cluster
    too), with the clock of their Redis."""
    return list(await scripts.STATS(redis, [keys.workers()], [RQ_NONE]))


async def _none() -> list[Any]:
    return []


async def _depths(queue: Redis) -> list[Any]:
    """The queues rq knows of and their lengths, on the queue's own Redis (name, depth, ...):
    its set of queues, then their lengths in one pipeline."""
    names = sorted(await queue.smembers(Queue.redis_queues_keys))  # type: ignore[misc]
    if not names:
        return []
    async with queue.pipeline(transaction=False) as pipe:
        for key in names:
            pipe.llen(key)
        depths = await pipe.execute()
    prefix = len(Queue.redis_queue_namespace_prefix)
    return [x for key, n in zip(names, depths, strict=True) for x in (key[prefix:], n)]


def _pairs_raw(flat: list[Any]) -> list[tuple[Any, Any]]:
    return list(zip(flat[::2], flat[1::2], strict=True))


def _pairs(flat: list[Any]) -> dict[str, Any]:
    return {(k.decode() if isinstance(k, bytes) else k): v for k, v in _pairs_raw(flat)}
