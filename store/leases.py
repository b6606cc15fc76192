"""Leases: which rollouts a live worker is generating, and until when.

One sorted set per deployment (member: rollout id, score: expiry in unix ms). A worker takes
a lease before it opens an attempt, renews all of its leases in one command (``ZADD XX GT``:
never resurrects a lease a reaper removed, never moves one backwards) and drops a lease when
the attempt ends. Anything left with an expiry in the past belongs to a worker that died,
stalled or lost its connection: the reaper (``workers.reaper``) deals with it.

A worker's leases are also listed in a set of its own (``holder``), kept by the same round trip
that takes or drops each lease: when its process dies (``store.presence``) a reaper finds them
there at once, instead of waiting for their expiry. The set is a hint, never the authority: a
rollout found in it is reaped only while its live attempt is still that worker's.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from redis.asyncio import Redis

from store import scripts
from store.keys import Keys


def now_ms() -> int:
    return int(time.time() * 1000)


class Leases:
    def __init__(self, client: Redis, keys: Keys | None = None, *, holder: str = "") -> None:
        """``holder``: the worker taking leases through this object (none: a reader)."""
        self.redis = client
        self.keys = keys = keys or Keys()
        self.key = keys.leases()
        self.quarantine_key = keys.quarantine()
        self.holder_key = keys.worker_leases(holder) if holder else ""

    async def take(self, rollout_id: str, ttl_s: float) -> None:
        await self.take_many([rollout_id], ttl_s)

    async def take_many(self, rollout_ids: list[str], ttl_s: float) -> list[None]:
        """``take`` of many leases in one round trip (the worker's coalesced starts). No
        MULTI (the two keys may sit in different Cluster slots): a lease missing from the
        holder's set only means the TTL, not presence, recovers it."""
        until = now_ms() + int(ttl_s * 1000)
        pipe = self.redis.pipeline(transaction=False)
        pipe.zadd(self.key, dict.fromkeys(rollout_ids, until))
        if self.holder_key:
            pipe.sadd(self.holder_key, *rollout_ids)
        await pipe.execute()
        return [None] * len(rollout_ids)

    async def renew(self, rollout_ids: Iterable[str], ttl_s: float) -> None:
        """Extend every lease still held, in one round trip."""
        ids = list(rollout_ids)
        if ids:
            until = now_ms() + int(ttl_s * 1000)
            await self.redis.zadd(self.key, dict.fromkeys(ids, until), xx=True, gt=True)

    async def drop(self, rollout_id: str) -> None:
        await self.drop_many([rollout_id])

    async def drop_many(self, rollout_ids: list[str]) -> list[None]:
        """``drop`` of many leases in one round trip (the worker's coalesced ends)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.zrem(self.key, *rollout_ids)
        if self.holder_key:
            pipe.srem(self.holder_key, *rollout_ids)
        await pipe.execute()
        return [None] * len(rollout_ids)

    async def held_by(self, worker_id: str) -> list[str]:
        """The rollouts ``worker_id`` leased and did not drop (some may be leased by another
        worker since: the caller checks whose attempt is live)."""
        members: set[bytes] = await self.redis.smembers(self.keys.worker_leases(worker_id))  # type: ignore[misc]
        return sorted(m.decode() for m in members)

    async def forget_holder(self, worker_id: str) -> None:
        """Drop the list of a dead worker's leases, once they are dealt with."""
        await self.redis.delete(self.keys.worker_leases(worker_id))

    async def expired(self, limit: int = 100) -> list[tuple[str, int]]:
        """Leases whose expiry has passed, oldest first: ``(rollout id, expiry ms)``."""
        rows = await self.redis.zrangebyscore(
            self.key, "-inf", now_ms(), start=0, num=limit, withscores=True
        )
        return [(member.decode(), int(score)) for member, score in rows]

    async def expiry(self, rollout_id: str) -> int | None:
        score = await self.redis.zscore(self.key, rollout_id)
        return None if score is None else int(score)

    async def release_if_unchanged(self, rollout_id: str, seen_expiry: int) -> bool:
        return bool(await scripts.RELEASE_LEASE(self.redis, [self.key], [rollout_id, seen_expiry]))

    async def quarantine(self, rollout_id: str, seen_expiry: int, reason: str) -> bool:
        """Move an expired lease to the quarantine with ``reason``, unless renewed meanwhile."""
        keys = [self.key, self.quarantine_key]
        reply = await scripts.QUARANTINE_LEASE(self.redis, keys, [rollout_id, seen_expiry, reason])
        return bool(reply)

    async def quarantined(self) -> dict[str, str]:
        """Every quarantined rollout with the reason it was set aside."""
        rows: dict[bytes, bytes] = await self.redis.hgetall(self.quarantine_key)  # type: ignore[misc]
        return {k.decode(): v.decode(errors="replace") for k, v in rows.items()}
