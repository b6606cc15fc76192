"""Ending rollouts from outside a worker: cancel, and acknowledge (delete) ended ones.

Cancel appends ``Cancelled``. A pending or aborted rollout ends at once. A live one ends too:
``Cancelled`` takes the sequence number after its last checkpoint and fences its attempt, so
its worker learns of it from Redis at its next checkpoint (the append is refused as stale),
stops generating it, and keeps nothing it had not saved. The tokens already saved stay in the
log and come back with the result.

Acknowledge deletes an ended rollout's log, snapshot, completion entry and rq job in one
script (``lua/ack.lua``); a rollout that has not ended is never deleted. With the queue on a
Redis of its own, the jobs go first, on the queue, then the rest (``store.ack_apart``); on
Redis Cluster, ordered steps each in one slot (``store.ack_cluster``).

Both go to Redis ``BULK_CHUNK`` rollouts at a time (``store.bulk``): a whole batch's worth in
one transaction would keep every other client (the workers' lease renewals) waiting.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from redis.asyncio import Redis

from statemachine import RolloutState, Status, commands
from store import ack_apart, ack_cluster, bulk, scripts
from store.errors import AppendRefused, RolloutNotFound, SequenceConflict, StoreError
from store.event_store import EventStore, read_head, submitted_record

# Appends of a cancel that lose a race with the rollout's worker (its checkpoint took the
# sequence number) are redone on the new state, after a short jittered pause; a worker
# checkpoints a rollout at most a few times a second, so a few rounds suffice.
CANCEL_ROUNDS = 30
CANCEL_BACKOFF_S = (0.001, 0.05)


class RolloutEnded(StoreError, ValueError):
    """The rollouts named have ended already (done, failed or cancelled): nothing changed."""

    def __init__(self, ended: dict[str, str]) -> None:
        shown = ", ".join(f"{rid} ({status})" for rid, status in list(ended.items())[:5])
        super().__init__(f"{len(ended)} rollout(s) have ended and cannot be cancelled: {shown}")
        self.ended = ended


@dataclass(frozen=True, slots=True)
class AckReport:
    acked: list[str] = field(default_factory=list)
    live: list[str] = field(default_factory=list)  # not ended: kept
    missing: list[str] = field(default_factory=list)  # acknowledged or expired before


async def heads(store: EventStore, ids: Sequence[str]) -> list[RolloutState | Exception]:
    """Each rollout's state without token data, one result per id, a round trip per
    ``BULK_CHUNK`` (pipelined, not a transaction: no instant is needed across rollouts)."""
    out: list[RolloutState | Exception] = []
    for part in bulk.chunks(ids):
        async with store.redis.pipeline(transaction=False) as pipe:
            for rid in part:
                read_head(pipe, store.keys, rid)
            found = await pipe.execute()
        for i, rid in enumerate(part):
            head, sub = found[2 * i], submitted_record(found[2 * i + 1])
            try:
                if head is None or sub is None:
                    raise RolloutNotFound(rid)
                out.append(store.decode_head(rid, head, sub))
            except Exception as exc:
                out.append(exc)
    return out


async def cancel(
    store: EventStore, ids: Sequence[str], reason: str, *, refuse_ended: bool
) -> list[str]:
    """Cancel every rollout of ``ids`` that has not ended; returns the ids cancelled.

    ``refuse_ended``: raise ``RolloutEnded`` (cancelling nothing) if one of them has ended
    otherwise than cancelled, and ``RolloutNotFound`` if one does not exist; those cancelled
    already are listed as cancelled, so that a cancel retried as it was (its reply lost, its
    replicas short) is answered as the first was. Otherwise (a batch's or a group's rollouts)
    ended ones are skipped, and so are those acknowledged or expired already, which had ended
    too (a trainer acknowledges the groups it took while ``take=k`` runs)."""
    states = await heads(store, ids)
    ended = {}
    for rid, s in zip(ids, states, strict=True):
        if isinstance(s, RolloutNotFound) and not refuse_ended:
            continue
        if isinstance(s, Exception):
            raise s
        if s.terminal and not (refuse_ended and s.status is Status.CANCELLED):
            ended[rid] = s.status.value
    if ended and refuse_ended:
        raise RolloutEnded(ended)
    todo = [s for s in states if isinstance(s, RolloutState) and not s.terminal]
    # Named and cancelled already: cancelled, as far as this call is concerned.
    cancelled = [s.rollout_id for s in states if refuse_ended and isinstance(s, RolloutState)
                 and s.status is Status.CANCELLED]  # fmt: skip
    # A transaction per chunk, not one for all (store/bulk.py says what that gives up).
    for part in bulk.chunks(todo):
        cancelled += await _cancel_chunk(store, part, reason)
    return cancelled


async def _cancel_chunk(store: EventStore, todo: Sequence[RolloutState], reason: str) -> list[str]:
    cancelled: list[str] = []
    delay = CANCEL_BACKOFF_S[0]
    for _ in range(CANCEL_ROUNDS):
        if not todo:
            return cancelled
        results = await store.append_many([(s, [commands.cancel(s, reason)]) for s in todo])
        retry = []
        for s, result in zip(todo, results, strict=True):
            if isinstance(result, RolloutState):
                cancelled.append(s.rollout_id)
            elif isinstance(result, SequenceConflict):
                retry.append(s.rollout_id)
            elif not isinstance(result, AppendRefused):
                raise result
        if retry:
            await asyncio.sleep(random.uniform(0, delay))
            delay = min(CANCEL_BACKOFF_S[1], delay * 2)
        fresh = await heads(store, retry)
        todo = [s for s in fresh if isinstance(s, RolloutState) and not s.terminal]
    raise StoreError(f"could not cancel {len(todo)} rollout(s) in {CANCEL_ROUNDS} rounds")


async def ack(
    store: EventStore, ids: Sequence[str], batches: Sequence[str], *, queue: Redis | None = None
) -> AckReport:
    """Delete the ended rollouts of ``ids`` (``batches[i]`` is the batch of ``ids[i]``).
    ``queue``: the queue's Redis, when it is not the store's: the rollouts' jobs are deleted
    there first (``store.ack_apart``), and ``ack.lua`` touches no rq key."""
    keys = store.keys
    if store.on_cluster is not None:
        if queue is None:  # a cluster store's client always has one (store.queue_redis)
            raise ValueError("an ack on Redis Cluster needs the queue's Redis")
        replies = []
        for part_ids, part_batches in zip(bulk.chunks(ids), bulk.chunks(batches), strict=True):
            replies += await ack_cluster.ack(store.on_cluster, keys, part_ids, part_batches, queue)
        return _report(ids, replies)
    prefix = "rq:" if queue is None else ""
    calls = [
        ((*keys.rollout(rid), keys.completions(batch)), [prefix])
        for rid, batch in zip(ids, batches, strict=True)
    ]
    replies = []
    # A round trip per chunk: a bounded pipeline (apart, three more: store, queue, queue).
    for part_ids, part in zip(bulk.chunks(ids), bulk.chunks(calls), strict=True):
        if queue is not None:
            await ack_apart.drop_jobs(
                queue, await ack_apart.ended_jobs(store.redis, keys, part_ids)
            )
        replies += await scripts.ACK.many(store.redis, part)
    return _report(ids, replies)


def _report(ids: Sequence[str], replies: Sequence[list[bytes]]) -> AckReport:
    report = AckReport()
    for rid, reply in zip(ids, replies, strict=True):
        {b"ok": report.acked, b"live": report.live, b"missing": report.missing}[reply[0]].append(
            rid
        )
    return report
