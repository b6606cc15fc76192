"""A submit's store steps on Redis Cluster (``store.batches`` with a cluster store; the queue is
always on a Redis of its own there, pushed to after these, as ``store.submit_apart`` says).

The batch's creation spans three slots on a cluster (the batch record, the index of batches,
the weight log), so it is three steps, in one order: the newest weight version read and the
batch added to the index (``ZADD NX``, keeping a retry's first place) in one pipeline, then the
record written by ``create_batch.lua`` given the batch's key alone. Index first, as
``store.sessions.note`` does: a crash in between leaves an indexed batch with no record, which
every reader skips (``RolloutClient.batches``), where the other order would leave a recorded
batch that a trainer re-attaching after a crash never finds. The version is no longer read in
the same step as the creation: it was read there to save a round trip, not for its meaning (a
version published in between could as well have been published a moment later).

A chunk of new rollouts spreads over many slots (a group's samples share one: ``Keys.grouped``),
so its store step is one ``submit_chunk.lua`` call per slot, each counting ``pending`` into that
slot's counters (``Keys.slot_counters``, the hash the slot's appends keep), all of a chunk's
calls sent in one cluster pipeline: one round trip per master. By their text (EVAL): a cluster
pipeline refuses EVALSHA, and a replica promoted by a failover has no script cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis import Redis

from store import scripts
from store.keys import Keys
from store.prepared import _Prepared
from store.queue import new_job_ids
from store.slots import key_slot

SUBMIT_CHUNK = scripts.Script("submit_chunk", by_text=True)
CREATE_BATCH = scripts.Script("create_batch", by_text=True)


def create_batch(conn: Redis, call: tuple[list[str], list[Any]]) -> list[bytes]:
    """``create_batch.lua``'s reply ({outcome, newest weight entry id}) for the keys and
    arguments ``store.batches`` made for one Redis, in the cluster's three steps."""
    (batch, index, weights), args = call
    batch_id, at = args[0], float(args[7])
    with conn.pipeline(transaction=False) as pipe:
        pipe.xrevrange(weights, "+", "-", count=1)
        pipe.zadd(index, {batch_id: at}, nx=True)
        latest, _ = pipe.execute()
    outcome, _ = _eval(conn, CREATE_BATCH, [batch], args)
    return [outcome, latest[0][0] if latest else b""]


def record_chunk(conn: Redis, keys: Keys, part: Sequence[_Prepared]) -> list[Any]:
    """The store step of one chunk (``submit_chunk.lua``'s store-only form, a call per slot);
    per rollout, in ``part``'s order, the reply the one-call form gives (``store.submit_apart``
    reads it: {"ok", "pending", job id}, {"dup", status, jobs} or {"conflict"})."""
    by_slot: dict[int, list[int]] = {}
    for i, p in enumerate(part):
        by_slot.setdefault(key_slot(p.keys[1].encode()), []).append(i)
    job_ids = new_job_ids(len(part))
    with conn.pipeline(transaction=False) as pipe:
        for slot, members in by_slot.items():
            call_keys = [keys.slot_counters(slot)]
            args: list[Any] = [len(members), 0]
            for i in members:
                p = part[i]
                call_keys += [p.keys[0], p.keys[1]]
                # The record and the head as lua/append.lua would get them (p.args[2:4]).
                args += [p.args[2], p.args[3], job_ids[i]]
            pipe.execute_command(  # type: ignore[no-untyped-call]
                "EVAL", SUBMIT_CHUNK.text, len(call_keys), *call_keys, *args
            )
        replies = pipe.execute()
    out: list[Any] = [None] * len(part)
    for members, reply in zip(by_slot.values(), replies, strict=True):
        for i, status in zip(members, reply, strict=True):
            out[i] = status
    return out


def _eval(conn: Redis, script: scripts.Script, keys: Sequence[str], args: Sequence[Any]) -> Any:
    return conn.execute_command("EVAL", script.text, len(keys), *keys, *args)  # type: ignore[no-untyped-call]


__all__ = ["create_batch", "record_chunk"]
