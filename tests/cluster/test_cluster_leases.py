"""The lease index on a real Redis Cluster: split in ``CLUSTER_LEASE_SHARDS`` sorted sets by a
hash of the rollout id, each in a slot of its own (one index renewed by 1,000 workers would
be one master's hot key), and read, renewed, reaped and released as the one index is on one
Redis."""

from __future__ import annotations

import asyncio

from redis.asyncio.cluster import RedisCluster as ClusterClient

from store import defaults
from store.event_store import EventStore
from store.leases import Leases
from store.slots import key_slot


async def test_leases_spread_over_shards_on_every_master_and_work_as_one_index(
    store: EventStore, cluster_client: ClusterClient
) -> None:
    keys = store.keys
    assert keys.lease_shards == defaults.CLUSTER_LEASE_SHARDS
    ids = [f"b.{g}.{s}" for g in range(32) for s in range(8)]
    leases = Leases(cluster_client, keys, holder="w1")
    await leases.take_many(ids, 0.5)
    held = {s: await cluster_client.zcard(keys.leases(s)) for s in range(keys.lease_shards)}
    assert sum(held.values()) == len(ids) and all(held.values())  # every shard holds some
    masters = {cluster_client.get_node_from_key(keys.leases(s)).name
               for s in range(keys.lease_shards)}  # fmt: skip
    assert len(masters) == 3, masters  # and the shards sit on every master
    assert len({key_slot(keys.leases(s).encode()) for s in range(keys.lease_shards)}) == 16
    view = await leases.read(ids[:10])
    assert view.held == len(ids) and view.expired == 0
    assert all(0 < (view.left_ms(r) or 0) <= 500 for r in ids[:10])

    # Renewed, the leases outlive their first TTL; the rest lapse and are reaped oldest first.
    renewed = ids[:100]
    await asyncio.sleep(0.2)
    await leases.renew(renewed, 5.0)
    await asyncio.sleep(0.5)
    lapsed = await leases.expired(limit=1000)
    assert sorted(r for r, _ in lapsed) == sorted(ids[100:])
    assert [e for _, e in lapsed] == sorted(e for _, e in lapsed)
    assert len(await leases.expired(limit=7)) == 7
    rid, expiry = lapsed[0]
    assert await leases.expiry(rid) == expiry
    assert await leases.release_if_unchanged(rid, expiry)
    assert not await leases.release_if_unchanged(rid, expiry)  # gone: nothing to release
    other, seen = lapsed[1]
    assert await leases.quarantine(other, seen, "unreadable")
    assert (await leases.quarantined()) == {other: "unreadable"}
    assert (await leases.read([other])).left_ms(other) is None

    await leases.drop_many(ids)
    assert (await leases.read()).held == 0
    assert await leases.held_by("w1") == []
