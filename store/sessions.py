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
from dataclasses import dataclass, replace

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from statemachine import Status, codec, harness_commands
from store import batches, defaults
from store.affinity import Affinity
from store.batches import BatchInfo
from store.cluster_appends import ClusterUnsupported
from store.errors import RolloutNotFound, SequenceConflict
from store.event_store import HEAD, EventStore
from store.keys import Keys
from store.lifecycle import AckReport

GONE = "gone"  # the status listed for a rollout acknowledged or expired on its own


def refuse_on_cluster(redis: Redis) -> None:
    """Sessions are not offered on Redis Cluster (``ClusterUnsupported``), refused before
    anything is written: a session's calls are batches in slots of their own beside its index,
    its acknowledgement deletes keys of all of them at once, its calls' jobs prefer a worker
    through hints beside the queue, and its turns are episodes, whose tool-call indexes span
    slots (docs/cluster-plan.md, M1)."""
    if isinstance(redis, RedisCluster):
        raise ClusterUnsupported(
            "sessions (X-Session-ID, session=, harness turns) are not offered on Redis Cluster "
            "yet: their keys span hash slots; serve them from a store on one Redis"
        )


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
    refuse_on_cluster(redis)
    key, worker = keys.session(session_id), keys.session_worker(session_id)
    async with redis.pipeline(transaction=True) as pipe:
        pipe.zadd(key, {batch_id: at}, nx=True)
        pipe.set(worker, "", nx=True)
        if retention_s > 0:
            pipe.expire(key, retention_s + defaults.SESSION_GRACE_S)
            pipe.expire(worker, retention_s + defaults.SESSION_GRACE_S)
            # The turn index (store.harness_turns) lives as long (a missing key: a no-op).
            pipe.expire(keys.session_turns(session_id), retention_s + defaults.SESSION_GRACE_S)
        pipe.get(worker)
        added, *_, last = await pipe.execute()
    return bool(added), (last.decode() or None) if last else None


async def note_turn(redis: Redis, keys: Keys, session_id: str, batch_id: str, entry: str,
                    at: float, retention_s: int) -> str | None:  # fmt: skip
    """``note`` for a call that is a later turn of a harness-driven episode, with its turn
    index entry (``store.harness_turns``) in the same transaction (one slot: the session's).
    Returns the session's worker (None if none started a call yet)."""
    refuse_on_cluster(redis)
    key, worker, turns = keys.session(session_id), keys.session_worker(session_id), (
        keys.session_turns(session_id))  # fmt: skip
    async with redis.pipeline(transaction=True) as pipe:
        pipe.zadd(key, {batch_id: at}, nx=True)
        pipe.set(worker, "", nx=True)
        pipe.hsetnx(turns, batch_id, entry)
        if retention_s > 0:
            for k in (key, worker, turns):
                pipe.expire(k, retention_s + defaults.SESSION_GRACE_S)
        pipe.get(worker)
        *_, last = await pipe.execute()
    return (last.decode() or None) if last else None


async def begin(
    redis: Redis, keys: Keys, session_id: str | None, batch_id: str, retention_s: int
) -> tuple[bool, Affinity | None]:
    """``note`` for a submit that may name a session: whether its entry was added, and the
    call's affinity (``store.affinity``: its jobs prefer the session's worker); nothing for
    none."""
    if session_id is None:
        return False, None
    refuse_on_cluster(redis)
    added, last = await note(redis, keys, session_id, batch_id, time.time(), retention_s)
    return added, Affinity(session_id, last)


async def release(redis: Redis, keys: Keys, session_id: str) -> bool:
    """The session's trajectory ended (SkyRL's ``/finish_session``): forget the worker its
    calls prefer, so no later hint holds a place for it; its calls stay listed until they are
    acknowledged or expire. Whether it named one."""
    refuse_on_cluster(redis)
    return bool(await redis.unlink(keys.session_worker(session_id)))


async def unnote(redis: Redis, keys: Keys, session_id: str, batch_id: str) -> None:
    """Take back an entry ``note`` added for a submit refused as a ``BatchConflict``: the
    batch id belongs to another submission, perhaps another session's call. A session left
    with no call loses its worker record too (``note`` made it; nothing would expire it
    sooner than the session's retention)."""
    refuse_on_cluster(redis)
    key = keys.session(session_id)
    async with redis.pipeline(transaction=True) as pipe:
        pipe.zrem(key, batch_id)
        pipe.exists(key)
        _, left = await pipe.execute()
    if not left:
        await redis.unlink(keys.session_worker(session_id))


async def batch_ids(redis: Redis, keys: Keys, session_id: str) -> list[str]:
    """The session's calls' batch ids in order, batches gone or never recorded included."""
    refuse_on_cluster(redis)
    return [b.decode() for b in await redis.zrange(keys.session(session_id), 0, -1)]


async def calls(redis: Redis, keys: Keys, session_id: str) -> list[tuple[str, float, BatchInfo]]:
    """The session's recorded calls in order: (batch id, when made, its record). A call that
    is a later turn of a harness-driven episode (``store.harness_turns``) has no batch record
    of its own: its record names its episode (``BatchInfo.turn``)."""
    refuse_on_cluster(redis)
    entries = await redis.zrange(keys.session(session_id), 0, -1, withscores=True)
    if not entries:
        return []
    async with redis.pipeline(transaction=False) as pipe:
        for b, _ in entries:
            pipe.hgetall(keys.batch(b.decode()))
        pipe.hgetall(keys.session_turns(session_id))
        *records, turns = await pipe.execute()
    out = []
    for (b, at), fields in zip(entries, records, strict=True):
        batch_id = b.decode()
        if fields:
            out.append((batch_id, float(at), batches.BatchInfo.parse(batch_id, fields)))
        elif b in turns:
            rid, turn, _ = turns[b].decode().split(" ")
            info = batches.BatchInfo.turn_of(batch_id, float(at), rid, int(turn))
            out.append((batch_id, float(at), info))
        # else acknowledged, expired, or noted by a submit that never recorded
    return out


async def listing(redis: Redis, keys: Keys, session_id: str) -> list[SessionCall]:
    """``RolloutClient.session``: the calls, each with its rollouts' states (one round trip
    for the states of all)."""
    refuse_on_cluster(redis)
    found = await calls(redis, keys, session_id)
    ids = [r for _, _, info in found for r in info.ids]
    async with redis.pipeline(transaction=False) as pipe:
        for rid in ids:
            pipe.hget(keys.snapshot(rid), HEAD)
        heads = await pipe.execute()
    states = iter(GONE if h is None else codec.snapshot_status(h, rollout_id=r)
                  for r, h in zip(ids, heads, strict=True))  # fmt: skip
    listed = [SessionCall(b, at, info, tuple(next(states) for _ in info.ids))
              for b, at, info in found]  # fmt: skip
    return _turn_statuses(listed)


def _turn_statuses(listed: list[SessionCall]) -> list[SessionCall]:
    """A call that is a turn of a harness-driven episode (``store.harness_turns``) reads as
    its turn: done once the turn ended, which it has if a later call of the session fed the
    episode's next turn, or if the episode waits for its next call (``awaiting_tool``: no
    plain rollout is ever in it); a turn under way reads as its episode does."""
    last: dict[str, int] = {}
    for i, call in enumerate(listed):
        for rid in call.ids:
            last[rid] = i
    out = []
    for i, call in enumerate(listed):
        statuses = tuple(
            s if s == GONE else "done"
            if last[rid] > i or s == Status.AWAITING_TOOL.value else s
            for rid, s in zip(call.ids, call.statuses, strict=True)
        )  # fmt: skip
        out.append(replace(call, statuses=statuses))
    return out


async def rollouts(redis: Redis, keys: Keys, session_id: str) -> list[str]:
    """Every rollout of the session's recorded calls, in call order (what a cancel covers),
    each once (the turns of one episode are one rollout)."""
    refuse_on_cluster(redis)
    found = [r for _, _, info in await calls(redis, keys, session_id) for r in info.ids]
    return list(dict.fromkeys(found))


async def ack(
    redis: Redis,
    keys: Keys,
    session_id: str,
    ack_batch: Callable[..., Awaitable[AckReport]],
    store: EventStore | None = None,
) -> AckReport:
    """``RolloutClient.ack(session=)``: each call's batch acknowledged whole (``ack_batch``:
    the client's ``ack``), then the index deleted once nothing of the session is live. With
    ``store``, a harness-driven episode of the session that waits for its next call ends first
    (``session_end``): the trainer is done with the session, and a later call of it starts
    an episode of its own."""
    refuse_on_cluster(redis)
    report = AckReport()
    listed = await batch_ids(redis, keys, session_id)
    turns = keys.session_turns(session_id)
    if store is not None:
        await _end_waiting(store, await rollouts(redis, keys, session_id))
    for b in listed:
        if await redis.hexists(turns, b):  # type: ignore[misc]
            continue  # a later turn's call: acknowledged with its episode's first call
        with contextlib.suppress(RolloutNotFound):  # acknowledged or expired already
            part = await ack_batch(batch_id=b)
            report.acked.extend(part.acked)
            report.live.extend(part.live)
            report.missing.extend(part.missing)
    if not report.live:
        # With the index go the turn calls' records and their completion streams.
        streams = [keys.completions(b) for b in listed]
        await redis.unlink(keys.session(session_id), keys.session_worker(session_id), turns,
                           *streams)  # fmt: skip
    return report


async def _end_waiting(store: EventStore, ids: Sequence[str]) -> None:
    """End the harness-driven episodes of ``ids`` that wait for a next call."""
    for rid in ids:
        try:
            state = await store.head(rid)
        except RolloutNotFound:
            continue  # acknowledged or expired already
        events = harness_commands.end_session(state)
        if events:
            # A call fed it meanwhile: it is live, and the ack reports it so.
            with contextlib.suppress(SequenceConflict):
                await store.append_chain(state, events)
