"""A Redis Cluster's masters, each with one slot it serves: where a question that every
master must answer for itself is asked (``WAIT`` for replicas, the write probe), through a key
of that slot (``store.slots.slot_tag``), so the cluster client routes it there."""

from __future__ import annotations

from redis.asyncio.cluster import ClusterNode, RedisCluster


async def one_slot_each(client: RedisCluster) -> list[tuple[ClusterNode, int]]:
    """Every master in the client's slot map with the first slot it serves (the map is read
    once if it was not yet). A master that serves no slot holds no store key: not listed."""
    await client.initialize()
    found: dict[str, tuple[ClusterNode, int]] = {}
    for slot, nodes in sorted(client.nodes_manager.slots_cache.items()):
        if nodes:
            found.setdefault(nodes[0].name, (nodes[0], slot))
    return list(found.values())
