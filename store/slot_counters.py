"""The deployment's counters on Redis Cluster: kept per slot by the appends of that slot's
rollouts (``Keys.slot_counters``, lua/append.lua's KEYS[1]), summed here on read.

One counters hash on one master would take an HINCRBY from every checkpoint of the fleet
(>= 62.5k/s at 1M tokens/s: docs/cluster-plan.md, section 4), and could not be in the slot of
the rollout whose append counts. Split by slot, each increment is in the transaction it
counts, and the load spreads as the rollouts do. A read sums 16,384 small hashes, pipelined
per master: for the few readers (stats, metrics), never on a worker's write path.
"""

from __future__ import annotations

from collections import Counter

from redis.asyncio.cluster import RedisCluster

from store.keys import Keys
from store.slots import SLOTS


async def summed(client: RedisCluster, keys: Keys) -> dict[str, int]:
    """Every slot's counters added up: rollouts by state (live ones now, terminal ones ever)
    and tokens generated, as ``Keys.stats`` holds them on one Redis."""
    total: Counter[str] = Counter()
    async with client.pipeline(transaction=False) as pipe:
        for slot in range(SLOTS):
            pipe.hgetall(keys.slot_counters(slot))
        for counts in await pipe.execute():
            for field, n in counts.items():
                total[field.decode()] += int(n)
    return dict(total)
