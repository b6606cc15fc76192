"""Leases: which rollouts a live worker is generating, and until when.

One sorted set per deployment (member: rollout id, score: expiry in unix ms). A worker takes
a lease before it opens an attempt, renews all of its leases in one command (``XX GT``: never
resurrects a lease a reaper removed, never moves one backwards) and drops a lease when the
attempt ends. Anything left with an expiry in the past belongs to a worker that died,
stalled or lost its connection: the reaper (``workers.reaper``) deals with it.

One clock judges every lease: Redis's. Expiries are computed inside the scripts that take and
renew (``lua/set_leases.lua``: ``TIME`` + TTL), and "expired" is decided by the scripts that
read them (``lua/expired_leases.lua``, ``lua/read_leases.lua``), never from a host's
``time.time()``. Workers whose clocks disagree (by more than a TTL, or stepped mid-run) thus
never take each other's rollouts over, and one whose clock is behind still renews. On Redis
Cluster the clock is that of the node holding the lease index.

Why scripts and not one key per lease (``SET PX``, ``PEXPIRE``, also judged by Redis's clock):
per-lease keys make a renewal N commands and leave the reaper nothing to list (an expired key is
gone). Measured on redis-server 7.0, one renewal of 256 leases (in brackets: 2048): the script
costs Redis ~0.13-0.16 ms of CPU (1.0-1.6), the plain ``ZADD XX GT`` it replaces 0.05-0.06
(0.5), per-lease ``PEXPIRE`` 0.07 (0.65); the round trip seen by the worker is 0.6-0.9 ms
(3.2-3.4) for the script, 0.8-1.1 (4.2-4.4) for the ZADD and 2.0-2.5 (17-21) for the keys.
Once a second per worker, the script's extra CPU is noise.

A worker's leases are also listed in a set of its own (``holder``), kept by the same round trip
that takes or drops each lease: when its process dies (``store.presence``) a reaper finds them
there at once, instead of waiting for their expiry. The set is a hint, never the authority: a
rollout found in it is reaped only while its live attempt is still that worker's.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from store import defaults, scripts
from store.keys import Keys


@dataclass(frozen=True, slots=True)
class LeaseView:
    """The lease index at one instant of Redis's clock (``Leases.read``)."""

    now_ms: int  # Redis's clock when read, unix ms
    held: int  # leases in the index
    expired: int  # of which past their expiry: a reaper takes them back within a pass
    expiries: dict[str, int | None]  # the rollouts asked about: expiry (unix ms), or no lease
    # Until when no lease counts as lapsed: Redis refused writes shortly before (unix ms;
    # 0: it did not), so a lease may have lapsed for want of a renewal (lua/lease_grace.lua).
    grace_until_ms: int = 0

    def left_ms(self, rollout_id: str) -> int | None:
        """How long the rollout's lease has left (<= 0: expired), or None: no lease. Within
        the grace after Redis refused writes, a lapsed lease has until the grace ends."""
        expiry = self.expiries.get(rollout_id)
        return None if expiry is None else max(expiry, self.grace_until_ms) - self.now_ms


class Leases:
    def __init__(
        self,
        client: Redis,
        keys: Keys | None = None,
        *,
        holder: str = "",
        refusal_grace_s: float = defaults.STORE_REAP_GRACE_S,
    ) -> None:
        """``holder``: the worker taking leases through this object (none: a reader);
        ``refusal_grace_s``: how long after Redis last refused a write no lease counts as
        lapsed (``lua/lease_grace.lua``)."""
        self.redis = client
        self.keys = keys = keys or Keys()
        self.key = keys.leases()  # the one index on one Redis; shard 0 on a cluster
        self.refusals_key = keys.lease_refusals()
        self.shards = keys.lease_shards
        self.grace_ms = _ms(refusal_grace_s)
        self.quarantine_key = keys.quarantine()
        self.holder_key = keys.worker_leases(holder) if holder else ""

    async def take(self, rollout_id: str, ttl_s: float) -> None:
        await self.take_many([rollout_id], ttl_s)

    async def take_many(self, rollout_ids: list[str], ttl_s: float) -> list[None]:
        """``take`` of many leases in one round trip (the worker's coalesced starts). No
        MULTI (the two keys may sit in different Cluster slots): a lease missing from the
        holder's set only means the TTL, not presence, recovers it. The script goes by its
        text (``SET_LEASES`` is ``by_text``): no NOSCRIPT can split this pipeline."""
        pipe = self.redis.pipeline(transaction=False)
        for key, ids in self._by_index(rollout_ids):
            pipe.execute_command(*scripts.SET_LEASES.invocation(), 1, key, "take", _ms(ttl_s), *ids)
        if self.holder_key:
            pipe.sadd(self.holder_key, *rollout_ids)
        await pipe.execute()
        return [None] * len(rollout_ids)

    def take_steps(self, rollout_ids: list[str], ttl_s: float) -> list[scripts.Step]:
        """``take_many``'s commands as steps of a caller's transaction: a worker takes an
        attempt's lease in the very transaction that opens the attempt (``Checkpointer.append``,
        ``before``), one round trip less per attempt than a lease of its own, and no moment
        where one is there without the other. A MULTI that spans the lease index and the
        rollout's keys, as the appends' own already do (issue 32 for Redis Cluster)."""
        steps: list[scripts.Step] = [
            scripts.Call(scripts.SET_LEASES, [key], ["take", _ms(ttl_s), *ids])
            for key, ids in self._by_index(rollout_ids)
        ]
        if self.holder_key:
            steps.append(("SADD", self.holder_key, *rollout_ids))
        return steps

    async def renew(self, rollout_ids: Iterable[str], ttl_s: float) -> int:
        """Extend every lease still held, in one round trip; returns Redis's clock (unix ms),
        which the worker's heartbeat is stamped with (read even when nothing is held)."""
        if self.shards == 1:
            args: list[scripts.Arg] = ["renew", _ms(ttl_s), *rollout_ids]
            return int(await scripts.SET_LEASES(self.redis, [self.key], args))
        # One call per shard holding some, pipelined (a batch per master); the clock is the
        # first shard's, as the heartbeat needs one (masters' clocks agree within NTP).
        parts = self._by_index(rollout_ids) or [(self.key, [])]
        pipe = self.redis.pipeline(transaction=False)
        for key, ids in parts:
            pipe.execute_command(*scripts.SET_LEASES.invocation(), 1, key, "renew", _ms(ttl_s),
                                 *ids)  # fmt: skip
        return int((await pipe.execute())[0])

    async def drop(self, rollout_id: str) -> None:
        await self.drop_many([rollout_id])

    async def drop_many(self, rollout_ids: list[str]) -> list[None]:
        """``drop`` of many leases in one round trip (the worker's coalesced ends)."""
        pipe = self.redis.pipeline(transaction=False)
        for key, ids in self._by_index(rollout_ids):
            pipe.zrem(key, *ids)
        if self.holder_key:
            pipe.srem(self.holder_key, *rollout_ids)
        await pipe.execute()
        return [None] * len(rollout_ids)

    async def forget_many(self, rollout_ids: list[str]) -> list[None]:
        """Take rollouts off this holder's set only: their leases went with the step that
        ended their attempts (an episode's turn ending at a tool call, lua/tool_call_index.lua),
        and the lease under their id now may be another worker's."""
        if self.holder_key:
            await self.redis.srem(self.holder_key, *rollout_ids)  # type: ignore[misc]
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
        """Leases whose expiry has passed by Redis's clock, oldest first:
        ``(rollout id, expiry ms)``; none within the grace after Redis last refused a write
        (``lua/lease_grace.lua``: nobody could renew a lease then, so its lapse says nothing
        of its worker)."""
        replies = await self._each_shard(scripts.EXPIRED_LEASES, [limit, self.grace_ms])
        found = [(rows[i].decode(), int(rows[i + 1]))
                 for _, rows, _ in replies for i in range(0, len(rows), 2)]  # fmt: skip
        return sorted(found, key=lambda row: row[1])[:limit]

    async def _each_shard(
        self, script: scripts.Script, args: list[scripts.Arg], ids: list[list[str]] | None = None
    ) -> list[Any]:
        """``script`` on every shard of the index with its refusals hash (each judged on its
        own master, with its own grace), ``ids[k]`` after ``args`` for shard k: one call on
        one Redis; on a cluster one pipeline (a batch per master), the scripts by their text
        (a cluster's pipelines refuse EVALSHA)."""
        if self.shards == 1:
            return [await script(self.redis, [self.key, self.refusals_key],
                                 [*args, *(ids[0] if ids else [])])]  # fmt: skip
        pipe = self.redis.pipeline(transaction=False)
        for shard in range(self.shards):
            keys = [self.keys.leases(shard), self.keys.lease_refusals(shard)]
            extra = ids[shard] if ids else []
            pipe.execute_command("EVAL", script.text, 2, *keys, *args, *extra)
        return list(await pipe.execute())

    async def read(self, rollout_ids: Sequence[str] = ()) -> LeaseView:
        """Redis's clock, the index's counts and the expiry of each of ``rollout_ids``, read
        at one instant."""
        asked: list[list[str]] = [[] for _ in range(self.shards)]
        for rid in rollout_ids:
            asked[self.keys.lease_shard(rid)].append(rid)
        views = []
        replies = await self._each_shard(scripts.READ_LEASES, [self.grace_ms], asked)
        for ids, (now, held, expired, expiries, grace) in zip(asked, replies, strict=True):
            views.append(LeaseView(
                now_ms=int(now), held=int(held), expired=int(expired),
                expiries={rid: None if e is None else int(e)
                          for rid, e in zip(ids, expiries, strict=True)},
                grace_until_ms=int(grace),
            ))  # fmt: skip
        return views[0] if len(views) == 1 else _merged(views)

    async def left_ms(self, rollout_id: str) -> int | None:
        """How long the rollout's lease has left by Redis's clock (<= 0: expired, and a reaper
        will take it back), or None: nobody holds one."""
        shard = self.keys.lease_shard(rollout_id)  # its shard alone, not the whole index
        keys = [self.keys.leases(shard), self.keys.lease_refusals(shard)]
        now, _, _, (expiry,), grace = await scripts.READ_LEASES(
            self.redis, keys, [self.grace_ms, rollout_id]
        )
        expiries = {rollout_id: None if expiry is None else int(expiry)}
        view = LeaseView(int(now), 0, 0, expiries, grace_until_ms=int(grace))
        return view.left_ms(rollout_id)

    async def expiry(self, rollout_id: str) -> int | None:
        """The lease's expiry as stored (unix ms by Redis's clock): what ``release_if_unchanged``
        and ``quarantine`` compare with. Whether it has passed is ``left_ms``'s to say."""
        score = await self.redis.zscore(self.index_of(rollout_id), rollout_id)
        return None if score is None else int(score)

    async def release_if_unchanged(self, rollout_id: str, seen_expiry: int) -> bool:
        key = self.index_of(rollout_id)
        return bool(await scripts.RELEASE_LEASE(self.redis, [key], [rollout_id, seen_expiry]))

    def index_of(self, rollout_id: str) -> str:
        """The lease index (shard) holding ``rollout_id``'s lease."""
        return self.keys.leases(self.keys.lease_shard(rollout_id))

    def _by_index(self, rollout_ids: Iterable[str]) -> list[tuple[str, list[str]]]:
        """``rollout_ids`` grouped by their lease index, in the order first met."""
        groups: dict[str, list[str]] = {}
        for rid in rollout_ids:
            groups.setdefault(self.index_of(rid), []).append(rid)
        return list(groups.items())

    async def quarantine(self, rollout_id: str, seen_expiry: int, reason: str) -> bool:
        """Move an expired lease to the quarantine with ``reason``, unless renewed meanwhile."""
        if isinstance(self.redis, RedisCluster):
            # The lease index and the quarantine are in different slots: set aside first,
            # then the lease released if unchanged (else taken back out). Released first, a
            # crash in between would leave an unreadable live rollout neither leased nor set
            # aside, which no reaper sees again.
            await self.redis.hset(self.quarantine_key, rollout_id, reason)
            if await self.release_if_unchanged(rollout_id, seen_expiry):
                return True
            await self.redis.hdel(self.quarantine_key, rollout_id)
            return False
        keys = [self.index_of(rollout_id), self.quarantine_key]
        reply = await scripts.QUARANTINE_LEASE(self.redis, keys, [rollout_id, seen_expiry, reason])
        return bool(reply)

    async def quarantined(self) -> dict[str, str]:
        """Every quarantined rollout with the reason it was set aside."""
        rows: dict[bytes, bytes] = await self.redis.hgetall(self.quarantine_key)  # type: ignore[misc]
        return {k.decode(): v.decode(errors="replace") for k, v in rows.items()}


def _ms(seconds: float) -> int:
    return int(seconds * 1000)


def _merged(views: list[LeaseView]) -> LeaseView:
    """The shards' views as one, on the first shard's clock: each expiry and grace moved by
    the difference between its own master's clock and that one, so that ``left_ms`` is what
    the shard's own master would say."""
    now = views[0].now_ms
    expiries: dict[str, int | None] = {}
    grace = 0
    for v in views:
        shift = now - v.now_ms
        expiries.update({r: None if e is None else e + shift for r, e in v.expiries.items()})
        if v.grace_until_ms:
            grace = max(grace, v.grace_until_ms + shift)
    return LeaseView(now_ms=now, held=sum(v.held for v in views),
                     expired=sum(v.expired for v in views), expiries=expiries,
                     grace_until_ms=grace)  # fmt: skip
