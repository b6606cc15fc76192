"""The lease index at a fleet of 1,000 workers, for bench_cluster.py (issue 32: "global keys
that would be hot at 1,000 workers are spread (leases, counters), with the figures that justify
it"). Today the lease index is one sorted set for the fleet (store/leases.py), so one master of
a cluster takes every worker's heartbeat and every reaper pass.

On one plain redis-server (``appendfsync`` as ``--fsync``), measured side by side:

- one index holding ``workers`` x 128 leases (ids ``<batch>.<group>.<sample>``, as the trainer
  makes them), each worker's heartbeat one ``SET_LEASES`` "renew" of its 128 ids with the TTL
  (``Leases.renew``), one round trip; and its reaper pass one ``EXPIRED_LEASES`` (keys: the
  index and its refusals hash; args: limit 100, grace 0), as ``Leases.expired`` sends it;
- the same leases spread over 16 shards (16 sorted sets, a rollout's shard a stable hash of
  its id: CRC32 mod 16), a heartbeat one ``SET_LEASES`` per shard of the worker's ids, a reaper
  pass one ``EXPIRED_LEASES`` per shard, each pipelined in one round trip.

Each worker sends its own round trip (one after another), as a fleet's heartbeats arrive: a
renewal is its own pass of Redis's event loop (its own fsync under ``always``), never batched
with another worker's. The sides alternate, each going first in every other round. Redis CPU
is ``used_cpu_user + used_cpu_sys`` deltas (INFO): parsing, the script, the AOF and its fsync;
beside it the script's own time by Redis's clock (commandstats of EVAL: ``*_script_*``).
No lease is past its expiry, as in a healthy fleet: a reaper pass finds nothing.

At 1,000 workers, each heartbeating and reaping once a second (store/defaults.py: HEARTBEAT_S,
REAP_INTERVAL_S), the one index's master spends ``1000 x (renew + reap)`` of CPU a second
(``lease_index_core_share_at_1000_workers``, a fraction of one core); a shard ``1000 x (renew +
reap over 16 shards) / 16`` (``lease_shard_core_share_at_1000_workers``), each shard placed on
a master of its own or beside others. The per-worker cost depends on the index's size (a
skiplist update is O(log n)): a run with fewer workers understates it a little.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aredis

from store import defaults, scripts
from store.keys import Keys
from store.redis_server import RedisServer

FLEET = 1_000  # the workers the core shares are computed for
PER_WORKER = 128  # leases a worker holds: rollouts in flight
SHARDS = defaults.CLUSTER_LEASE_SHARDS  # the store's own split on a cluster
REAP_LIMIT = 100  # Leases.expired's default
TTL_MS = int(defaults.LEASE_TTL_S * 1000)
Calls = tuple[list[str], list[scripts.Arg]]  # one script call: its keys, its arguments


def worker_ids(worker: int) -> list[str]:
    """A worker's 128 rollouts: 16 groups of 8 of one batch."""
    return [f"lease-bench.{worker * 16 + j // 8}.{j % 8}" for j in range(PER_WORKER)]


class Side:
    """One layout of the same leases, the store's own (``Keys.lease_shards``: 1 on one Redis,
    ``CLUSTER_LEASE_SHARDS`` on a cluster, a rollout's shard the CRC32 of its id)."""

    def __init__(self, shards: int) -> None:
        self.layout = Keys(lease_shards=shards)

    def split(self, ids: list[str]) -> list[tuple[int, list[str]]]:
        parts: dict[int, list[str]] = {}
        for rid in ids:
            parts.setdefault(self.layout.lease_shard(rid), []).append(rid)
        return sorted(parts.items())

    def set_leases(self, mode: str, ids: list[str]) -> list[Calls]:
        return [([self.layout.leases(k)], [mode, TTL_MS, *p]) for k, p in self.split(ids)]

    async def take(self, client: aredis.Redis, ids: list[str]) -> None:
        await scripts.SET_LEASES.many(client, self.set_leases("take", ids))

    async def renew(self, client: aredis.Redis, ids: list[str]) -> None:
        """A worker's heartbeat: one call on one index, else one per shard, one round trip."""
        calls = self.set_leases("renew", ids)
        if len(calls) == 1:
            await scripts.SET_LEASES(client, *calls[0])
        else:
            await scripts.SET_LEASES.many(client, calls)

    async def reap(self, client: aredis.Redis) -> None:
        """A reaper pass: what has expired, on the index or on every shard, one round trip."""
        layout = self.layout
        calls: list[Calls] = [
            ([layout.leases(k), layout.lease_refusals(k)], [REAP_LIMIT, 0])
            for k in range(layout.lease_shards)
        ]
        if len(calls) == 1:
            await scripts.EXPIRED_LEASES(client, *calls[0])
        else:
            await scripts.EXPIRED_LEASES.many(client, calls)


async def used(client: aredis.Redis) -> tuple[float, float]:
    """Redis's CPU so far (s), and its scripts' time by its own clock (commandstats of EVAL
    and EVALSHA, s): the script alone, without parsing, the AOF or the fsync."""
    cpu, stats = await client.info("cpu"), await client.info("commandstats")
    scripts_s = sum(stats.get(f"cmdstat_{c}", {}).get("usec", 0) for c in ("eval", "evalsha"))
    return float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]), scripts_s / 1e6


async def lease_index(fsync: str, workers: int = FLEET, rounds: int = 2) -> dict[str, Any]:
    """Redis CPU per worker's heartbeat and reaper pass on one index and over 16 shards, and
    the share of a core each takes at ``FLEET`` workers (see the module's docstring)."""
    sides = {"one": Side(1), "shards": Side(SHARDS)}
    ids = [worker_ids(w) for w in range(workers)]
    spent = {(side, op): 0.0 for side in sides for op in ("renew", "reap", "renew_script")}
    with RedisServer(config={"appendfsync": fsync}) as server:
        client = aredis.Redis.from_url(server.url)
        for side in sides.values():
            for w in range(0, workers, 16):
                await side.take(client, [r for mine in ids[w : w + 16] for r in mine])
            await side.reap(client)  # the reaper's script cached (EVALSHA), as in a fleet
        for r in range(rounds + 1):  # round 0 uncounted: a warm-up of both sides
            for name in ("one", "shards") if r % 2 == 0 else ("shards", "one"):
                side = sides[name]
                cpu, script = await used(client)
                for mine in ids:
                    await side.renew(client, mine)
                renewed, renew_script = await used(client)
                for _ in ids:
                    await side.reap(client)
                reaped, _ = await used(client)
                if r:
                    spent[name, "renew"] += renewed - cpu
                    spent[name, "renew_script"] += renew_script - script
                    spent[name, "reap"] += reaped - renewed
        await client.aclose()
    us = {k: v / (workers * rounds) * 1e6 for k, v in spent.items()}  # per worker, per pass
    one = FLEET * (us["one", "renew"] + us["one", "reap"]) / 1e6
    spread = FLEET * (us["shards", "renew"] + us["shards", "reap"]) / 1e6
    return {
        "lease_workers_measured": workers,
        "lease_renew_us_per_worker_one_index": round(us["one", "renew"], 2),
        f"lease_renew_us_per_worker_{SHARDS}_shards": round(us["shards", "renew"], 2),
        # The script's own time (commandstats), which the rest of a renewal's CPU adds to.
        "lease_renew_script_us_per_worker_one_index": round(us["one", "renew_script"], 2),
        f"lease_renew_script_us_per_worker_{SHARDS}_shards": round(us["shards", "renew_script"], 2),
        "lease_reap_us_per_pass_one_index": round(us["one", "reap"], 2),
        f"lease_reap_us_per_pass_{SHARDS}_shards": round(us["shards", "reap"], 2),
        # What spreading costs in all: 16 calls where there was one.
        f"lease_{SHARDS}_shards_over_one_index_cpu_ratio": round(spread / one, 3),
        f"lease_index_core_share_at_{FLEET}_workers": round(one, 4),
        f"lease_shard_core_share_at_{FLEET}_workers": round(spread / SHARDS, 4),
    }
