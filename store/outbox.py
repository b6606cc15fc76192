"""Completions on Redis Cluster: from the slot of the rollout that ended to its batch's.

On one Redis the append that ends a rollout also adds its entry to the batch's completion
stream, in one transaction. On a cluster the batch's keys are in another slot, which no
transaction reaches, so the append writes the completion into its own slot's outbox
(lua/append.lua, "outbox"), atomically with the event, and the appender delivers it right
after: the entry into the batch's stream, once (lua/deliver_completion.lua), then the entry's
id into the snapshot and the outbox cleared (lua/completion_delivered.lua). An appender that
dies in between leaves the completion in the outbox, where ``sweep`` finds it. So a completion
is never lost and never delivered twice; what a cluster adds is a moment (one round trip, or a
sweep) when the rollout has ended and its batch's stream does not show it yet.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from redis.asyncio.cluster import RedisCluster

from statemachine import RolloutState
from store import scripts
from store.cluster_commit import Block, commit
from store.errors import RolloutNotFound
from store.keys import Keys
from store.slots import SLOTS, key_slot

DELIVER = scripts.Script("deliver_completion")
DELIVERED = scripts.Script("completion_delivered")
# Older than this, an outbox entry is its appender's no more: the sweep delivers it.
SWEEP_AFTER_MS = 5_000


@dataclass(frozen=True, slots=True)
class Ended:
    """A rollout whose end is in its slot's outbox."""

    rollout_id: str
    batch_id: str
    status: str


async def deliver(
    client: RedisCluster, keys: Keys, ended: Sequence[Ended], *, replicas: int = 0
) -> None:
    """Each completion into its batch's stream, then cleared from its outbox: two round trips
    (batch slots, then rollout slots), each one per master touched."""
    if not ended:
        return
    first = await commit(client, [_to_batch(keys, e) for e in ended], replicas=replicas)
    second = []
    for e, replies in zip(ended, first, strict=True):
        if isinstance(replies, Exception):
            raise replies
        (reply,) = replies
        if isinstance(reply, Exception):
            raise reply
        cid, ttl = reply
        second.append(_to_rollout(keys, e.rollout_id, cid, int(ttl)))
    for replies in await commit(client, second, replicas=replicas):
        if isinstance(replies, Exception):
            raise replies
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply


def _to_batch(keys: Keys, e: Ended) -> Block:
    done = keys.completions(e.batch_id)
    # Rollouts of no batch have no record: a key in their shared stream's slot that no one
    # writes stands for it (no retention, as on one Redis).
    record = keys.batch(e.batch_id) if e.batch_id else f"{{{done}}}:record"
    call = scripts.Call(DELIVER, (done, keys.completion_ids(e.batch_id), record),
                        (e.rollout_id, e.status))  # fmt: skip
    return Block(key_slot(done.encode()), (call,))


def _to_rollout(keys: Keys, rid: str, cid: bytes, ttl: int) -> Block:
    log, snap = keys.rollout(rid)
    slot = key_slot(snap.encode())
    call = scripts.Call(DELIVERED, (log, snap, keys.slot_outbox(slot)), (rid, cid, ttl))
    return Block(slot, (call,))


async def pending(
    client: RedisCluster, keys: Keys, *, older_than_ms: int = SWEEP_AFTER_MS
) -> list[tuple[int, str]]:
    """(slot, rollout id) of every completion left in an outbox for ``older_than_ms``: one
    pipelined read of all 16,384 outboxes, sent per master by redis-py."""
    before = int(time.time() * 1000) - older_than_ms
    async with client.pipeline(transaction=False) as pipe:
        for slot in range(SLOTS):
            pipe.zrangebyscore(keys.slot_outbox(slot), "-inf", before)
        found = await pipe.execute()
    return [(slot, rid.decode()) for slot, rids in enumerate(found) for rid in rids]


async def sweep(
    client: RedisCluster,
    keys: Keys,
    head: Callable[[str], Awaitable[RolloutState]],
    *,
    replicas: int = 0,
    older_than_ms: int = SWEEP_AFTER_MS,
) -> int:
    """Deliver what appenders left in the outboxes (they died between the append and the
    delivery); the number delivered. ``head``: the store's ``EventStore.head`` (a rollout's
    status and batch). A rollout gone meanwhile (acknowledged, expired) leaves its outbox."""
    ended: list[Ended] = []
    for slot, rid in await pending(client, keys, older_than_ms=older_than_ms):
        try:
            state = await head(rid)
        except RolloutNotFound:
            await client.zrem(keys.slot_outbox(slot), rid)
            continue
        ended.append(Ended(rid, state.membership.batch_id, state.status.value))
    await deliver(client, keys, ended, replicas=replicas)
    return len(ended)
