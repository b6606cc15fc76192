"""Whether a worker's process is still there: its presence subscription, held and watched.

When a process dies (kill -9, OOM kill, a crash) its kernel closes its sockets at once, and Redis
drops the subscriptions of those connections with them. Every worker holds two subscriptions to
a channel of its own (``Presence.hold``), each on a connection of its own named after it (a
flaky link drops one connection at a time; a death closes both at once); reapers ask
Redis how many subscribers the registered workers' channels have (``PresenceWatch.gone``: one
``PUBSUB NUMSUB`` for all of them) and reap the leases of a worker whose count is 0 at once,
instead of after the lease TTL.

Why a subscription: it stays open as long as the process lives, whatever its event loop does
(the kernel holds the socket, so a worker blocked for seconds is still present); Redis' idle
``timeout`` never closes a subscribed client; and when the server does drop it, the read blocked
on it sees that at once and redis-py resubscribes on its first retry (~0.1 s). A pool connection
can be closed and reopened by redis-py at any moment. ``NUMSUB`` costs O(workers asked) and no
admin permission, where ``CLIENT LIST`` formats every client of the server for every caller.

What never counts as gone:
- one dropped connection (a flaky link, a middlebox): the worker's other subscription holds.
  Both are needed: a window sized by round trips measured before a link turned slow is too
  short for a resubscribe over it;
- a stalled or partitioned worker (SIGSTOP, a dead network link): its connection stays open
  (Redis sees no FIN), so the lease TTL recovers its rollouts and fencing refuses its late writes;
- an absence shorter than the worker's confirmation window (its connections dropped together,
  a link's flap, being re-established), nor one during which it renewed a lease (a process
  that renews is alive, whatever its subscriptions are doing). A resubscribe takes a few
  round trips: ~0.1 s on a LAN, 0.5-1.6 s over a link of 50-200 ms each way. So each worker
  registers its round trip to Redis, and its window is ``PRESENCE_RTT_FACTOR`` of them,
  between ``confirm_min_s`` (a dead worker on a LAN is still noticed in ~0.5 s) and
  ``confirm_s`` (two heartbeats);
- anyone for ``grace_s`` after Redis started: a restart closed every connection and every worker
  is reconnecting (the check reads the server's uptime with the second count);
- a worker that never subscribed (an older version; an ACL that refuses SUBSCRIBE): it is not in
  the registry, and its leases expire by their TTL as before.
If Redis refuses NUMSUB or INFO (an ACL), the watch turns itself off with one warning; leases
then expire by their TTL only.

Cost: at most one reaper of the whole fleet checks per ``check_s`` (it wins a ``SET NX PX``
token), only while leases exist: one HKEYS, one ZCARD and one NUMSUB; while someone is absent,
every ``check_s`` a NUMSUB, an SMEMBERS and a ZMSCORE of theirs, and INFO at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque

from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from redis.exceptions import NoPermissionError, ResponseError

from store import defaults, scripts
from store.connection import client_name, connect
from store.errors import unwritable
from store.keys import Keys

log = logging.getLogger("rollouts.presence")

# A worker re-registers this often while subscribed: a reaper that judged it gone during a long
# reconnect (and unregistered it) is corrected within this time.
REGISTER_EVERY_S = 5.0
# While confirming an absence, how often (at least) to look again at who came back or renewed.
CONFIRM_POLL_S = 0.05
# A worker registers the largest of its last few round trips to Redis (sampled at each
# registration, every REGISTER_EVERY_S): one slow sample keeps its reapers patient for a while.
ROUND_TRIPS_KEPT = 3
# Subscriptions each worker holds, each on a connection of its own. A process's death closes
# all of them at once; a flaky link drops one connection now and then, whose resubscribe over a
# slow link (several round trips) may outlast a confirmation window sized by round trips
# measured before the link turned slow (the soak's live slow-link worker judged gone). With
# two, one dropped connection leaves the worker present, whatever it registered.
SUBSCRIPTIONS = 2
# How long a worker waits between attempts to resubscribe after its own loop saw an error
# (redis-py's retries gave up, e.g. Redis down for longer than them): doubling up to the cap.
RESUBSCRIBE_S = (0.05, 1.0)


class Presence:
    """This worker's presence: ``SUBSCRIPTIONS`` subscriptions, each on a connection of its
    own."""

    def __init__(self, url: str, worker_id: str, keys: Keys | None = None) -> None:
        self.keys = keys or Keys()
        self.worker_id = worker_id
        name = client_name("dr-worker", worker_id)
        self.clients = [connect(url, client_name=name) for _ in range(SUBSCRIPTIONS)]
        self.client = self.clients[0]  # for the reads and writes that are not subscriptions
        self.channel = self.keys.presence_channel(worker_id)
        self.subscribed = asyncio.Event()  # one subscription at least confirmed and registered
        self.refused: str | None = None  # why Redis refused it (an ACL), if it did
        self._held: set[int] = set()  # the subscriptions confirmed and registered
        self._round_trips: deque[float] = deque(maxlen=ROUND_TRIPS_KEPT)  # seconds

    async def hold(self, stop: asyncio.Event) -> None:
        """Stay subscribed until ``stop`` is set, each subscription resubscribing whenever its
        connection drops."""
        await asyncio.gather(*(self._hold(i, stop) for i in range(len(self.clients))))

    async def _hold(self, i: int, stop: asyncio.Event) -> None:
        client, failures = self.clients[i], 0
        while not stop.is_set() and self.refused is None:
            pubsub = client.pubsub()
            try:
                await pubsub.subscribe(self.channel)
                await self._listen(i, pubsub, stop)
            except Exception as exc:
                if isinstance(exc, ResponseError) and _refusal(exc):
                    # NOPERM: no retry fixes an ACL. Nobody will watch this worker; its leases
                    # expire by their TTL as they always did.
                    await self._refused(exc)
                    return
                # Redis unreachable for longer than redis-py's retries: try again, with backoff
                # (from the first step again if it had been registered since).
                failures = 1 if i in self._held else failures + 1
                if failures == 1:
                    log.warning("worker %s: presence subscription lost; resubscribing",
                                self.worker_id, exc_info=True)  # fmt: skip
            finally:
                self._held.discard(i)
                if not self._held:
                    self.subscribed.clear()
                with contextlib.suppress(Exception):
                    # A dead connection's close must not hold up the next subscription.
                    await asyncio.wait_for(pubsub.aclose(), 1.0)  # type: ignore[no-untyped-call]
            first, cap = RESUBSCRIBE_S
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), min(cap, first * 2**failures))

    async def _refused(self, exc: ResponseError) -> None:
        if self.refused is not None:
            return  # the other subscription was refused first: said and done
        self.refused = f"{type(exc).__name__}: {exc}"
        log.warning(
            "worker %s: Redis refused its presence subscription (%s); if it dies, its rollouts "
            "are recovered when their leases expire", self.worker_id, exc,
        )  # fmt: skip
        with contextlib.suppress(Exception):
            # Registered before the ACL changed: unwatched from now on, never judged gone.
            await self.client.hdel(self.keys.presence(), self.worker_id)  # type: ignore[misc]

    async def _listen(self, i: int, pubsub: PubSub, stop: asyncio.Event) -> None:
        confirmed = False
        registered: float | None = None  # when it last registered (monotonic)
        while not stop.is_set():
            # Waits up to 1 s on the socket: a connection Redis closes is seen at once, and
            # redis-py reconnects and resubscribes inside this call.
            try:
                message = await pubsub.get_message(timeout=1.0)
            except ResponseError as exc:
                if unwritable(exc) is None:
                    raise
                # The reply to redis-py's health-check PING, which Redis refuses like a write
                # while it cannot persist (MISCONF): the subscription itself is intact.
                message = None
            if message is not None and message["type"] == "subscribe":
                confirmed, registered = True, None  # (re)subscribed: register at once
            due = registered is None or time.monotonic() - registered >= REGISTER_EVERY_S
            if confirmed and due:
                # Only once Redis confirmed the subscription: a registered worker is one whose
                # death a reaper can see.
                try:
                    await scripts.REGISTER_PRESENCE(
                        self.clients[i],
                        [self.keys.presence()],
                        [self.worker_id, await self._round_trip_ms(self.clients[i])],
                    )
                except ResponseError as exc:
                    if unwritable(exc) is None:
                        raise
                    # Redis refuses writes (out of memory, a failed disk write): the
                    # subscription is what shows this process alive, and it holds; dropping
                    # it would show a live worker gone. Registered again at the next turn.
                    continue
                registered = time.monotonic()
                self._held.add(i)
                self.subscribed.set()

    async def _round_trip_ms(self, client: Redis) -> int:
        """This worker's round trip to Redis (a PING), the largest of the last few: how long its
        reconnects take is a multiple of it, and reapers wait for it accordingly."""
        t0 = time.monotonic()
        await client.ping()  # type: ignore[misc]
        self._round_trips.append(time.monotonic() - t0)
        return math.ceil(max(self._round_trips) * 1000)

    async def close(self) -> None:
        """After ``hold`` returned. A worker that left no lease behind unregisters (no reaper
        need look for it); one that did stays registered, so its leases are reaped at once."""
        with contextlib.suppress(Exception):
            # Redis gone at shutdown: some reaper unregisters it later.
            if not await self.client.scard(self.keys.worker_leases(self.worker_id)):  # type: ignore[misc]
                await self.client.hdel(self.keys.presence(), self.worker_id)  # type: ignore[misc]
        for client in self.clients:
            await client.aclose()


class PresenceWatch:
    """The other workers' presence, as one reaper sees it."""

    def __init__(
        self,
        redis: Redis,
        keys: Keys | None = None,
        *,
        me: str = "",
        check_s: float = defaults.PRESENCE_CHECK_S,
        confirm_s: float = defaults.PRESENCE_CONFIRM_S,
        grace_s: float = defaults.PRESENCE_GRACE_S,
        confirm_min_s: float = defaults.PRESENCE_CONFIRM_MIN_S,
        store: Redis | None = None,
    ) -> None:
        """``redis``: where presence lives (the queue's Redis); ``store``: where the leases
        are, the store's (None: the same Redis)."""
        self.redis = redis
        self.store = store if store is not None else redis
        self.keys = keys or Keys()
        self.me = me  # the worker this watch runs in: present by definition
        self.check_s = check_s
        # An absence is confirmed over PRESENCE_RTT_FACTOR round trips of the worker (what it
        # registered), within [confirm_min_s, confirm_s]; confirm_s when it registered none.
        self.confirm_s = confirm_s
        self.confirm_min_s = min(confirm_min_s, confirm_s)
        self.grace_s = grace_s
        self.off: str | None = None  # why the watch turned itself off, if it did
        self.checks = 0  # checks this watch ran (it won the interval's token)
        self._grace_noted = False

    async def gone(self) -> list[str]:
        """Registered workers whose process is gone: absent for their confirmation window
        without renewing a lease, with Redis up for ``grace_s`` at least. [] when another reaper
        checks this interval or no lease exists. A check takes up to the longest window of the
        absent workers (at most ``confirm_s``)."""
        if self.off is not None:
            return []
        try:
            return await self._gone()
        except ResponseError as exc:
            if not _refusal(exc):
                raise  # e.g. BUSY or MISCONF: transient, the next check tries again
            # NOPERM (an ACL without PUBSUB or INFO) or a server without them: no retry fixes
            # that. Leases still expire by their TTL.
            self.off = f"{type(exc).__name__}: {exc}"
            log.warning(
                "cannot watch the workers' presence (%s): a dead worker's leases are now "
                "recovered when they expire (lease TTL), not at once", self.off,
            )  # fmt: skip
            return []

    async def forget(self, worker_id: str) -> None:
        """Unregister a gone worker whose leases were dealt with."""
        await self.redis.hdel(self.keys.presence(), worker_id)  # type: ignore[misc]

    async def _gone(self) -> list[str]:
        px = max(1, int(self.check_s * 1000))
        if not await self.redis.set(self.keys.presence_check(), self.me or "-", nx=True, px=px):
            return []  # another reaper checks this interval
        self.checks += 1
        shards = range(self.keys.lease_shards)
        if self.store is self.redis:
            pipe = self.redis.pipeline(transaction=False)
            pipe.hgetall(self.keys.presence())
            for shard in shards:
                pipe.zcard(self.keys.leases(shard))
            registry, *held = await pipe.execute()
        else:  # the registry with the queue, the leases with the store
            registry = await self.redis.hgetall(self.keys.presence())  # type: ignore[misc]
            pipe = self.store.pipeline(transaction=False)
            for shard in shards:
                pipe.zcard(self.keys.leases(shard))
            held = await pipe.execute()
        leased = sum(held)
        windows = {w.decode(): self._window(v) for w, v in registry.items()}
        windows.pop(self.me, None)
        workers = list(windows)
        if not workers or not leased:
            return []
        absent = await self._absent(workers, with_uptime=False)
        if absent:
            # Within the grace after a restart, nobody is worth a confirmation window.
            absent = await self._absent(absent, with_uptime=True)
        if absent:
            absent = await self._confirm({w: windows[w] for w in absent})
        # Again at the end: a restart during the window closed every connection.
        return await self._absent(absent, with_uptime=True) if absent else []

    def _window(self, registered: bytes) -> float:
        """How long an absence of this worker is confirmed: ``PRESENCE_RTT_FACTOR`` of the round
        trips it registered (``"<ms> <round trip ms>"``), bounded; the longest if it gave none
        (a worker from before issue 28 registered the time alone)."""
        parts = registered.split()
        if len(parts) != 2 or not parts[1].isdigit():
            return self.confirm_s
        window = defaults.PRESENCE_RTT_FACTOR * int(parts[1]) / 1000
        return min(self.confirm_s, max(self.confirm_min_s, window))

    async def _confirm(self, windows: dict[str, float]) -> list[str]:
        """Of the workers seen absent, those still absent at the end of their window that renewed
        none of their leases meanwhile. Looked at every ``check_s``: one that resubscribes or
        renews is cleared at once, so a live worker costs a check only as long as it is away."""
        absent = list(windows)
        seen = await self._expiries(absent)
        start = time.monotonic()
        end = start + max(windows.values())
        while absent and (left := end - time.monotonic()) > 0:
            await asyncio.sleep(min(max(self.check_s, CONFIRM_POLL_S), left))
            still = set(await self._absent(absent, with_uptime=False))
            now = await self._expiries(absent)
            absent = [w for w in absent if w in still and not _renewed(seen[w], now[w])]
            if all(time.monotonic() - start >= windows[w] for w in absent):
                break  # every one left has been away for its whole window
        return absent

    async def _expiries(self, workers: list[str]) -> dict[str, dict[str, float]]:
        """Each worker's leases and their expiries (scores of the lease index), as now."""
        pipe = self.store.pipeline(transaction=False)
        for w in workers:
            pipe.smembers(self.keys.worker_leases(w))
        held = [sorted(m.decode() for m in members) for members in await pipe.execute()]
        # Each rollout's score from its own shard of the index (one shard on one Redis).
        asked: list[list[str]] = []
        pipe = self.store.pipeline(transaction=False)
        for ids in held:
            by_shard: dict[int, list[str]] = {}
            for rid in ids:
                by_shard.setdefault(self.keys.lease_shard(rid), []).append(rid)
            for shard, part in by_shard.items():
                pipe.zmscore(self.keys.leases(shard), part)
                asked.append(part)
        scores: dict[str, float | None] = {}
        if asked:
            for part, row in zip(asked, await pipe.execute(), strict=True):
                scores.update(zip(part, row, strict=True))
        return {w: {r: s for r in ids if (s := scores[r]) is not None}
                for w, ids in zip(workers, held, strict=True)}  # fmt: skip

    async def _absent(self, workers: list[str], *, with_uptime: bool) -> list[str]:
        pipe = self.redis.pipeline(transaction=False)
        if with_uptime:
            pipe.info("server")
        pipe.pubsub_numsub(*(self.keys.presence_channel(w) for w in workers))
        replies = await pipe.execute()
        counts: list[tuple[bytes, int]] = replies[-1]
        absent = [w for w, (_, n) in zip(workers, counts, strict=True) if int(n) == 0]
        if with_uptime and absent:
            uptime = int(replies[0]["uptime_in_seconds"])
            if uptime < self.grace_s:
                # A restart closed every connection: the workers are reconnecting, not dead.
                if not self._grace_noted:
                    log.info(
                        "Redis started %d s ago: %d workers not reconnected yet; none is "
                        "judged gone before %.0f s (their leases still expire by TTL)",
                        uptime, len(absent), self.grace_s,
                    )  # fmt: skip
                    self._grace_noted = True
                return []
            self._grace_noted = False
        return absent


def _renewed(before: dict[str, float], now: dict[str, float]) -> bool:
    """Whether the worker renewed (or took) a lease: a live process does every heartbeat,
    however long its presence subscription takes to come back; a dead one cannot. A lease that
    vanished was dropped or reaped, which says nothing either way."""
    return any(expiry > before.get(rid, 0.0) for rid, expiry in now.items())


def _refusal(exc: ResponseError) -> bool:
    """Redis will never run this for us: a missing ACL permission, or a command it lacks."""
    return isinstance(exc, NoPermissionError) or "unknown" in str(exc).lower()
