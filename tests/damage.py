"""Damaging stored records on purpose, the way a disk or a buggy writer would."""

from __future__ import annotations

import redis.asyncio as aredis

from store import EventStore


async def damage_event(client: aredis.Redis, store: EventStore, rollout_id: str, seq: int) -> None:
    """Flip the last bytes of the rollout's event ``seq`` in place. Streams refuse to re-add an
    entry id at or below their last one, so the log is written again around it."""
    log = store.keys.log(rollout_id)
    entries = await client.xrange(log)
    await client.delete(log)
    for entry_id, fields in entries:
        record = fields[b"e"]
        if entry_id == f"0-{seq}".encode():
            record = record[:-2] + bytes(b ^ 0xFF for b in record[-2:])
        await client.xadd(log, {b"e": record}, id=entry_id)
