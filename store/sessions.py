"""Sessions: the calls of one trajectory, in the order they were made.

A harness names the trajectory a call belongs to (``X-Session-ID``, or the body's
``session_id``); the call's batch id goes into the session's index, a sorted set scored by
when the call was first made (``Keys.session``).

Written *before* the submit records the batch, as its own command: the index and the batch
live in different hash slots (a Cluster cannot run one script over both), so the two writes
cannot be one. In this order a crash between them leaves an entry naming a batch that does not
exist, which every reader skips (as it skips a batch acknowledged or expired since); the other
order would leave a recorded call its session does not list. A retry of the call (the same
batch id) keeps its first place (``ZADD NX``). The index expires with the retention of its
newest call (``defaults.SESSION_GRACE_S`` later, since rollouts are retained from when they
end), and acknowledging the session deletes it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from redis.asyncio import Redis

from statemachine import codec
from store import batches, defaults
from store.affinity import Affinity
from store.batches import BatchInfo
from store.errors import RolloutNotFound
from store.event_store import HEAD
from store.keys import Keys
from store.lifecycle import AckReport

GONE = "gone"  # the status listed for a rollout acknowledged or expired on its own


@dataclass(frozen=True, slots=True)
class SessionCall:
    """One call of a session: its batch (the call's rollouts: ``n`` samples of one prompt),
    when it was made, and its rollouts' states now."""

    batch_id: str
    at: float
    info: BatchInfo
    statuses: tuple[str, ...]  # a rollout's state, or GONE

    @property
    def ids(self) -> list[str]:
        return self.info.ids


def alone(ids: Sequence[str] | None, batch_id: str | None, group: int | None) -> None:
    if ids is not None or batch_id is not None or group is not None:
        raise ValueError("name a session alone: not with ids, a batch_id or a group")


async def note(redis: Redis, keys: Keys, session_id: str, batch_id: str, at: float,
               retention_s: int) -> tuple[bool, str | None]:  # fmt: skip
    """Add the call ``batch_id`` to the session's index (kept where it was for a retry):
    whether it was added (not there before), and the worker that started the session's
    latest call (None if none did yet: ``store.affinity``). The session's worker record is
    created empty with the index, and lives as long (a worker only overwrites it)."""
    key, worker = keys.session(session_id), keys.session_worker(session_id)
    async with redis.pipeline(transaction=True) as pipe:
        pipe.zadd(key, {batch_id: at}, nx=True)
        pipe.set(worker, "", nx=True)
        if retention_s > 0:
            pipe.expire(key, retention_s + defaults.SESSION_GRACE_S)
            pipe.expire(worker, retention_s + defaults.SESSION_GRACE_S)
        pipe.get(worker)
        added, *_, last = await pipe.execute()
    return bool(added), (last.decode() or None) if last else None


async def begin(
    redis: Redis, keys: Keys, session_id: str | None, batch_id: str, retention_s: int
) -> tuple[bool, Affinity | None]:
    """``note`` for a submit that may name a session: whether its entry was added, and the
    call's affinity (``store.affinity``: its jobs prefer the session's worker); nothing for
    none."""
    if session_id is None:
        return False, None
    added, last = await note(redis, keys, session_id, batch_id, time.time(), retention_s)
    return added, Affinity(session_id, last)


async def release(redis: Redis, keys: Keys, session_id: str) -> bool:
    """The session's trajectory ended (SkyRL's ``/finish_session``): forget the worker its
    calls prefer, so no later hint holds a place for it; its calls stay listed until they are
    acknowledged or expire. Whether it named one."""
    return bool(await redis.unlink(keys.session_worker(session_id)))


async def unnote(redis: Redis, keys: Keys, session_id: str, batch_id: str) -> None:
    """Take back an entry ``note`` added for a submit refused as a ``BatchConflict``: the
    batch id belongs to another submission, perhaps another session's call. A session left
    with no call loses its worker record too (``note`` made it; nothing would expire it
    sooner than the session's retention)."""
    key = keys.session(session_id)
    async with redis.pipeline(transaction=True) as pipe:
        pipe.zrem(key, batch_id)
        pipe.exists(key)
        _, left = await pipe.execute()
    if not left:
        await redis.unlink(keys.session_worker(session_id))


async def batch_ids(redis: Redis, keys: Keys, session_id: str) -> list[str]:
    """The session's calls' batch ids in order, batches gone or never recorded included."""
    return [b.decode() for b in await redis.zrange(keys.session(session_id), 0, -1)]


async def calls(redis: Redis, keys: Keys, session_id: str) -> list[tuple[str, float, BatchInfo]]:
    """The session's recorded calls in order: (batch id, when made, its record)."""
    entries = await redis.zrange(keys.session(session_id), 0, -1, withscores=True)
    if not entries:
        return []
    async with redis.pipeline(transaction=False) as pipe:
        for b, _ in entries:
            pipe.hgetall(keys.batch(b.decode()))
        records = await pipe.execute()
    out = []
    for (b, at), fields in zip(entries, records, strict=True):
        if fields:  # else acknowledged, expired, or noted by a submit that never recorded
            out.append((b.decode(), float(at), batches.BatchInfo.parse(b.decode(), fields)))
    return out


async def listing(redis: Redis, keys: Keys, session_id: str) -> list[SessionCall]:
    """``RolloutClient.session``: the calls, each with its rollouts' states (one round trip
    for the states of all)."""
    found = await calls(redis, keys, session_id)
    ids = [r for _, _, info in found for r in info.ids]
    async with redis.pipeline(transaction=False) as pipe:
        for rid in ids:
            pipe.hget(keys.snapshot(rid), HEAD)
        heads = await pipe.execute()
    states = iter(GONE if h is None else codec.snapshot_status(h, rollout_id=r)
                  for r, h in zip(ids, heads, strict=True))  # fmt: skip
    return [SessionCall(b, at, info, tuple(next(states) for _ in info.ids))
            for b, at, info in found]  # fmt: skip


async def rollouts(redis: Redis, keys: Keys, session_id: str) -> list[str]:
    """Every rollout of the session's recorded calls, in call order (what a cancel covers)."""
    return [r for _, _, info in await calls(redis, keys, session_id) for r in info.ids]


async def ack(
    redis: Redis, keys: Keys, session_id: str, ack_batch: Callable[..., Awaitable[AckReport]]
) -> AckReport:
    """``RolloutClient.ack(session=)``: each call's batch acknowledged whole (``ack_batch``:
    the client's ``ack``), then the index deleted once nothing of the session is live."""
    report = AckReport()
    for b in await batch_ids(redis, keys, session_id):
        with contextlib.suppress(RolloutNotFound):  # acknowledged or expired already
            part = await ack_batch(batch_id=b)
            report.acked.extend(part.acked)
            report.live.extend(part.live)
            report.missing.extend(part.missing)
    if not report.live:
        await redis.unlink(keys.session(session_id), keys.session_worker(session_id))
    return report
