"""Whether a worker's process is still there: its presence subscription, held and watched.

When a process dies (kill -9, OOM kill, a crash) its kernel closes its sockets at once, and Redis
drops the subscriptions of those connections with them. Every worker holds one subscription to
a channel of its own (``Presence.hold``), on a connection of its own named after it; reapers ask
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
- a stalled or partitioned worker (SIGSTOP, a dead network link): its connection stays open
  (Redis sees no FIN), so the lease TTL recovers its rollouts and fencing refuses its late writes;
- an absence shorter than ``confirm_s`` (a dropped connection being re-established);
- anyone for ``grace_s`` after Redis started: a restart closed every connection and every worker
  is reconnecting (the check reads the server's uptime with the second count);
- a worker that never subscribed (an older version; an ACL that refuses SUBSCRIBE): it is not in
  the registry, and its leases expire by their TTL as before.
If Redis refuses NUMSUB or INFO (an ACL), the watch turns itself off with one warning; leases
then expire by their TTL only.

Cost: at most one reaper of the whole fleet checks per ``check_s`` (it wins a ``SET NX PX``
token), only while leases exist: one HKEYS, one ZCARD and one NUMSUB, plus INFO when someone is
absent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from redis.exceptions import NoPermissionError, ResponseError

from store import defaults
from store.connection import client_name, connect
from store.keys import Keys
from store.leases import now_ms

log = logging.getLogger("rollouts.presence")

# A worker re-registers this often while subscribed: a reaper that judged it gone during a long
# reconnect (and unregistered it) is corrected within this time.
REGISTER_EVERY_S = 5.0
# How long a worker waits between attempts to resubscribe after its own loop saw an error
# (redis-py's retries gave up, e.g. Redis down for longer than them): doubling up to the cap.
RESUBSCRIBE_S = (0.05, 1.0)


class Presence:
    """This worker's presence: one subscription, on a connection of its own."""

    def __init__(self, url: str, worker_id: str, keys: Keys | None = None) -> None:
        self.keys = keys or Keys()
        self.worker_id = worker_id
        self.client = connect(url, client_name=client_name("dr-worker", worker_id))
        self.channel = self.keys.presence_channel(worker_id)
        self.subscribed = asyncio.Event()  # confirmed by Redis and registered
        self.refused: str | None = None  # why Redis refused it (an ACL), if it did
        self._failures = 0

    async def hold(self, stop: asyncio.Event) -> None:
        """Stay subscribed until ``stop`` is set, resubscribing whenever the connection drops."""
        while not stop.is_set():
            pubsub = self.client.pubsub()
            try:
                await pubsub.subscribe(self.channel)
                await self._listen(pubsub, stop)
            except Exception as exc:
                if isinstance(exc, ResponseError) and _refusal(exc):
                    # NOPERM: no retry fixes an ACL. Nobody will watch this worker; its leases
                    # expire by their TTL as they always did.
                    await self._refused(exc)
                    return
                # Redis unreachable for longer than redis-py's retries: try again, with backoff.
                self._failures += 1
                if self._failures == 1:
                    log.warning("worker %s: presence subscription lost; resubscribing",
                                self.worker_id, exc_info=True)  # fmt: skip
            finally:
                self.subscribed.clear()
                with contextlib.suppress(Exception):
                    # A dead connection's close must not hold up the next subscription.
                    await asyncio.wait_for(pubsub.aclose(), 1.0)  # type: ignore[no-untyped-call]
            first, cap = RESUBSCRIBE_S
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), min(cap, first * 2**self._failures))

    async def _refused(self, exc: ResponseError) -> None:
        self.refused = f"{type(exc).__name__}: {exc}"
        log.warning(
            "worker %s: Redis refused its presence subscription (%s); if it dies, its rollouts "
            "are recovered when their leases expire", self.worker_id, exc,
        )  # fmt: skip
        with contextlib.suppress(Exception):
            # Registered before the ACL changed: unwatched from now on, never judged gone.
            await self.client.hdel(self.keys.presence(), self.worker_id)  # type: ignore[misc]

    async def _listen(self, pubsub: PubSub, stop: asyncio.Event) -> None:
        confirmed = False
        registered: float | None = None  # when it last registered (monotonic)
        while not stop.is_set():
            # Waits up to 1 s on the socket: a connection Redis closes is seen at once, and
            # redis-py reconnects and resubscribes inside this call.
            message = await pubsub.get_message(timeout=1.0)
            if message is not None and message["type"] == "subscribe":
                confirmed, registered = True, None  # (re)subscribed: register at once
            due = registered is None or time.monotonic() - registered >= REGISTER_EVERY_S
            if confirmed and due:
                # Only once Redis confirmed the subscription: a registered worker is one whose
                # death a reaper can see.
                await self.client.hset(self.keys.presence(), self.worker_id, str(now_ms()))  # type: ignore[misc]
                registered = time.monotonic()
                self._failures = 0
                self.subscribed.set()

    async def close(self) -> None:
        """After ``hold`` returned. A worker that left no lease behind unregisters (no reaper
        need look for it); one that did stays registered, so its leases are reaped at once."""
        with contextlib.suppress(Exception):
            # Redis gone at shutdown: some reaper unregisters it later.
            if not await self.client.scard(self.keys.worker_leases(self.worker_id)):  # type: ignore[misc]
                await self.client.hdel(self.keys.presence(), self.worker_id)  # type: ignore[misc]
        await self.client.aclose()


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
    ) -> None:
        self.redis = redis
        self.keys = keys or Keys()
        self.me = me  # the worker this watch runs in: present by definition
        self.check_s = check_s
        self.confirm_s = confirm_s
        self.grace_s = grace_s
        self.off: str | None = None  # why the watch turned itself off, if it did
        self.checks = 0  # checks this watch ran (it won the interval's token)
        self._grace_noted = False

    async def gone(self) -> list[str]:
        """Registered workers whose process is gone: absent twice, ``confirm_s`` apart, with
        Redis up for ``grace_s`` at least. [] when another reaper checks this interval or no
        lease exists. A check takes about ``confirm_s`` when someone is absent."""
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
        pipe = self.redis.pipeline(transaction=False)
        pipe.hkeys(self.keys.presence())
        pipe.zcard(self.keys.leases())
        names, leased = await pipe.execute()
        workers = [w for w in (n.decode() for n in names) if w != self.me]
        if not workers or not leased:
            return []
        absent = await self._absent(workers, with_uptime=False)
        if not absent:
            return []
        await asyncio.sleep(self.confirm_s)
        return await self._absent(absent, with_uptime=True)

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


def _refusal(exc: ResponseError) -> bool:
    """Redis will never run this for us: a missing ACL permission, or a command it lacks."""
    return isinstance(exc, NoPermissionError) or "unknown" in str(exc).lower()
