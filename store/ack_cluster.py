"""An ack on Redis Cluster: ``lua/ack.lua``'s one step on one Redis becomes ordered steps, each
in one slot, each repeatable, the rollout deleted last (docs/cluster-plan.md, section 3, #4).

1. Each rollout's snapshot read (status, jobs, completion id): only ended ones go on.
2. An ended rollout whose completion is still in its slot's outbox (its appender has not
   delivered it yet) gets it delivered now (``store.outbox.deliver``, which lands once): so
   that step 4 finds its entry, instead of a later delivery adding it to the stream of a
   rollout acknowledged already.
3. Their jobs deleted on the queue's Redis (``store.ack_apart.drop_jobs``, ``ack.lua``'s rule).
4. Their completion entries removed from each batch's stream, found by the batch-slot record
   of delivered ids (``Keys.completion_ids``), with those records: one call per batch
   (``lua/drop_completions.lua``), in the batch's slot.
5. The rollouts deleted (``ack.lua``'s cluster form: log, snapshot and the slot outbox's
   entry, no rq key, no stream), in their own slots.

Steps 4 and 5 are one round trip per master each (``store.cluster_commit``). A crash between
any two leaves the rollout, which the next ack finds ended and takes through the same steps
(each finds its part done already). Deleting the rollout first would lose the record of its
jobs, and a completion delivered late would name a rollout that no longer exists.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from store import ack_apart, scripts
from store.cluster_commit import Block, commit
from store.keys import Keys
from store.outbox import Ended, deliver
from store.slots import key_slot

ACK = scripts.Script("ack", by_text=True)
DROP_COMPLETIONS = scripts.Script("drop_completions", by_text=True)


async def ack(
    client: RedisCluster,
    keys: Keys,
    ids: Sequence[str],
    batches: Sequence[str],
    queue: Redis,
) -> list[list[bytes]]:
    """Steps 1 to 5 for ``ids`` (``batches[i]``: the batch of ``ids[i]``); per rollout,
    ``ack.lua``'s reply ({"ok"}, {"missing"} or {"live", status}). Replica acknowledgement
    is the caller's, once for every master (``store.replicas.confirm``)."""
    async with client.pipeline(transaction=False) as pipe:
        for rid in ids:
            pipe.hmget(keys.snapshot(rid), ["st", "job", "cid"])
        found = await pipe.execute()
    ended = [(rid, batch, st, jobs, cid) for rid, batch, (st, jobs, cid)
             in zip(ids, batches, found, strict=True) if st in ack_apart.ENDED]  # fmt: skip
    undelivered = [Ended(rid, batch, st.decode()) for rid, batch, st, _, cid in ended if not cid]
    await deliver(client, keys, undelivered)
    await ack_apart.drop_jobs(queue, [j.decode() for *_, jobs, _ in ended
                                      for j in (jobs or b"").split()])  # fmt: skip
    by_batch: dict[str, list[str]] = {}
    for rid, batch, *_ in ended:
        by_batch.setdefault(batch, []).append(rid)
    await _all(client, [_completions(keys, b, rids) for b, rids in by_batch.items()])
    return [reply for block in await _all(client, [_rollout(keys, rid) for rid in ids])
            for reply in block]  # fmt: skip


def _completions(keys: Keys, batch: str, rids: list[str]) -> Block:
    done = keys.completions(batch)
    call = scripts.Call(DROP_COMPLETIONS, (done, keys.completion_ids(batch)), rids)
    return Block(key_slot(done.encode()), (call,))


def _rollout(keys: Keys, rid: str) -> Block:
    log, snap = keys.rollout(rid)
    slot = key_slot(snap.encode())
    call = scripts.Call(ACK, (log, snap, keys.slot_outbox(slot)), ("", "outbox", rid))
    return Block(slot, (call,))


async def _all(client: RedisCluster, blocks: list[Block]) -> list[list[Any]]:
    """Every block's replies, or the first error among them raised (the ack is repeated as
    it was: each step finds its done part done)."""
    out = await commit(client, blocks)
    for replies in out:
        if isinstance(replies, Exception):
            raise replies
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
    return out  # type: ignore[return-value]
