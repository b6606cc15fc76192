"""The event store's appends and reads on Redis Cluster (``EventStore`` on a ``RedisCluster``
client): the same records, scripts and replies as on one Redis, grouped by slot.

An append's transaction on one Redis holds every rollout of a checkpoint, the deployment's
counters and the batches' completion streams. On a cluster each slot's rollouts get a
MULTI/EXEC of their own with their slot's counters (``Keys.slot_counters``) and outbox
(``store.outbox``), and ``store.cluster_commit`` sends a master's blocks in one round trip,
with ``WAIT`` after them when replicas must confirm. What a cluster cannot hold in a rollout's
slot is not offered yet: steps of a caller's in the same transaction (a lease taken with its
attempt, a turn's job) and episodes' tool-call indexes (``ClusterUnsupported``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from redis.asyncio.cluster import RedisCluster

from store import scripts
from store.cluster_commit import Block, commit
from store.errors import StoreError
from store.keys import Keys
from store.log_reads import HEAD
from store.outbox import Ended, deliver
from store.prepared import _Prepared
from store.slots import key_slot

log = logging.getLogger("rollouts.cluster")


class ClusterUnsupported(StoreError, NotImplementedError):
    """An operation the store does not offer on Redis Cluster yet (docs/cluster-plan.md)."""


def check_supported(calls: Sequence[_Prepared], steps: Sequence[scripts.Step]) -> None:
    if steps:
        raise ClusterUnsupported("a caller's steps in an append's transaction, on Redis Cluster")
    if any(p.state.request.episode is not None for p in calls):
        raise ClusterUnsupported("episodes (their tool-call indexes span slots), on Redis Cluster")


async def run(
    client: RedisCluster, keys: Keys, replicas: int, calls: Sequence[_Prepared]
) -> list[tuple[list[Any], Any] | Exception]:
    """Every append of ``calls``, a slot's in one MULTI/EXEC; per call, lua/append.lua's reply
    words and its XADD's reply (None for a whole record), or the error that kept its slot's
    transaction from running (a master unreachable, replicas short: ``ReplicasNotAcked``)."""
    by_slot: dict[int, list[int]] = {}
    for i, p in enumerate(calls):
        by_slot.setdefault(key_slot(p.keys[1].encode()), []).append(i)
    blocks: list[Block] = []
    where: list[tuple[int, int, int | None, int]] = [(0, 0, None, 0)] * len(calls)
    for slot, members in by_slot.items():
        steps: list[scripts.Step] = []
        # A rollout's n-th event goes in the slot's n-th script call, as on one Redis.
        rounds: list[list[int]] = []
        seen: dict[str, int] = {}
        for i in members:
            n = seen.get(calls[i].event.rollout_id, 0)
            seen[calls[i].event.rollout_id] = n + 1
            if n == len(rounds):
                rounds.append([])
            rounds[n].append(i)
        outbox = keys.slot_outbox(slot)
        for round_ in rounds:
            script_keys: list[str] = [keys.slot_counters(slot)]
            args: list[scripts.Arg] = ["outbox"]
            for j, i in enumerate(round_):
                log, snap = calls[i].keys[:2]
                script_keys += (log, snap, outbox, snap)
                args += calls[i].script_args()
                xadd = None
                if not calls[i].whole:
                    xadd = len(steps)
                    steps += calls[i].ahead()
                where[i] = (len(blocks), -1, xadd, j)
            call_step = len(steps)
            steps.append(scripts.Call(scripts.APPEND, script_keys, args))
            for i in round_:
                b, _, xadd, j = where[i]
                where[i] = (b, call_step, xadd, j)
        blocks.append(Block(slot, steps))
    replies = await commit(client, blocks, replicas=replicas)
    out: list[tuple[list[Any], Any] | Exception] = []
    for b, call_step, xadd, j in where:
        block = replies[b]
        if isinstance(block, Exception):
            out.append(block)  # its master's, or its slot's: the other slots' stand
            continue
        batch = block[call_step]
        if isinstance(batch, Exception):
            raise batch  # the script itself failed: a bug, not an outage
        out.append((batch[j].split(), None if xadd is None else block[xadd]))
    return out


async def load_many(
    client: RedisCluster, keys: Keys, rollout_ids: Sequence[str]
) -> list[tuple[Any, Any]]:
    """Each rollout's snapshot head and log, read in one MULTI (one instant) per rollout, one
    round trip per master: (head, entries) as redis-py's own reads give them, or an error."""
    blocks = []
    for rid in rollout_ids:
        log, snap = keys.rollout(rid)
        blocks.append(
            Block(key_slot(snap.encode()), (("HGET", snap, HEAD), ("XRANGE", log, "-", "+")))
        )
    out: list[tuple[Any, Any]] = []
    for replies in await commit(client, blocks):
        if isinstance(replies, Exception):
            out.append((replies, replies))
            continue
        head, entries = replies
        if not isinstance(entries, Exception):
            entries = [(eid, dict(zip(f[::2], f[1::2], strict=True))) for eid, f in entries]
        out.append((head, entries))
    return out


async def deliver_ended(
    client: RedisCluster,
    keys: Keys,
    replicas: int,
    calls: Sequence[_Prepared],
    replies: Sequence[list[Any] | Exception],
) -> None:
    """The completions of the rollouts ``calls`` ended (their append ``ok``, or a ``dup``: a
    repeat whose first delivery may not have run), delivered (``store.outbox``). One that
    fails is left to the sweep: the ends themselves are stored, and so are their outboxes."""
    ended = [
        Ended(p.event.rollout_id, p.state.membership.batch_id, p.state.status.value)
        for p, reply in zip(calls, replies, strict=True)
        if isinstance(reply, list) and reply[0] in (b"ok", b"dup") and p.state.terminal
    ]
    try:
        await deliver(client, keys, ended, replicas=replicas)
    except Exception as exc:
        log.warning("completions of %d rollouts left to the outbox sweep: %r", len(ended), exc)
