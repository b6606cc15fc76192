"""What lua/append.lua answers, read: each event's reply words checked, a "taken" resolved
into a retry recognised ("dup") or the refusal it carries, and the refusal as the store's
error. For one Redis and for a cluster alike (``store.event_store``, ``store.cluster_appends``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis

from statemachine import Event, Submitted, fence_of
from store.errors import RolloutExists, SequenceConflict, StaleAttempt
from store.prepared import _Prepared


async def resolve_taken(redis: Redis, calls: Sequence[_Prepared], out: list[Any]) -> list[Any]:
    """``out`` with each "taken" reply resolved into "dup" (the stored record is the caller's)
    or the refusal it carries."""
    taken = [i for i, reply in enumerate(out) if isinstance(reply, list) and reply[0] == b"taken"]
    if taken:
        # Entries at or below the snapshot's seq never change (only whole rollouts are
        # deleted), so comparing after the transaction is as good as inside it.
        async with redis.pipeline(transaction=False) as pipe:
            for i in taken:
                entry = f"0-{calls[i].event.seq}"
                pipe.xrange(calls[i].keys[0], entry, entry)
            found = await pipe.execute()
        for i, entries in zip(taken, found, strict=True):
            same = len(entries) == 1 and entries[0][1].get(b"e") == calls[i].record
            out[i] = [b"dup"] if same else out[i][1:]
    return out


def checked(p: _Prepared, reply: list[bytes], xadd: Any) -> list[bytes]:
    if not p.whole and reply[0] == b"ok" and not isinstance(xadd, bytes):
        # Accepted, yet its XADD wrote nothing: the log is gone while its snapshot is not,
        # which nothing here does (ack and expiry take both; see lua/append.lua).
        raise AssertionError(f"{p.event.rollout_id} #{p.event.seq}: {xadd!r}")
    return reply


def refusal(reply: Any, event: Event) -> Exception | None:
    """The error an append's reply stands for (a refusal, or on a cluster the error that kept
    its transaction from running), None when it landed."""
    if isinstance(reply, Exception):
        return reply
    status = reply[0]
    if status in (b"ok", b"dup"):
        return None
    if status == b"stale":
        return StaleAttempt(event.rollout_id, event.seq, fence_of(event) or 0, int(reply[1]))
    if status == b"conflict":
        current = int(reply[1])
        if isinstance(event, Submitted):
            return RolloutExists(event.rollout_id, event.seq, current)
        return SequenceConflict(event.rollout_id, event.seq, current)
    raise AssertionError(f"append.lua returned {reply!r}")  # the script has no other replies
