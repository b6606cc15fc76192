"""What Redis holds, by kind, and whether it is back at its baseline once everything is
acknowledged (invariant 9: Redis holds in-flight and unacknowledged work only).

The baseline is taken after a warm-up batch was run and acknowledged (counters, rq's queue
set and the weight log exist by then), the final inventory after the drain, the last
acknowledgements and every worker's stop. Rollout data (logs, snapshots, batches, rq jobs,
leases, the quarantine) must all be gone, and the keyspace (``MEMORY USAGE`` of every key) may
not have grown by more than ``KEYSPACE_SLACK_BYTES``, leaving out two kinds that grow by
design and say nothing about rollouts: the workers' own bookkeeping (a SIGKILLed worker's rq
keys live out their TTL) and the weight log (one entry per published version).

Why not ``used_memory`` (what tests/workers/test_trainer_loop.py compares): Redis counts each
connected client's fixed buffers as data, not as client memory: ~38 KB a connection (measured:
5 more clients, +190 KB of ``used_memory_dataset``), and the soak ends with other connections
than it began with (workers replaced, the drain's readers). It is reported, with the INFO
breakdown, not judged.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis

from store.keys import Keys

# Ended-rollout data that must be gone after acknowledging everything.
MUST_BE_GONE = ("rollouts", "batches", "rq_jobs", "leases", "quarantine")
GROW_BY_DESIGN = ("workers", "weights")
# What the keyspace may have grown by: counters and rq's queue set change size with their
# contents' digits and encodings (a few hundred bytes); one left-over rollout is ~10 KB.
KEYSPACE_SLACK_BYTES = 4096
_SCAN_COUNT = 1000
NAMES_KEPT = 500  # keys named per kind, to tell what grew (a settled Redis holds a few dozen)
INFO_FIELDS = (
    "used_memory", "used_memory_overhead", "used_memory_dataset", "used_memory_scripts",
    "mem_clients_normal", "mem_aof_buffer",
)  # fmt: skip


def category(key: str, keys: Keys = Keys()) -> str:  # noqa: B008  (a frozen value object)
    ns = keys.namespace
    if key.startswith(f"{ns}:{{"):
        return "rollouts"
    if key.startswith(f"{ns}:batch:") or key == keys.batches():
        return "batches"
    if key == keys.leases():
        return "leases"
    if key == keys.lease_refusals():
        return "workers"  # the fleet's record of Redis's refusals (a few fields, kept)
    if key == keys.quarantine():
        return "quarantine"
    if key == keys.weights():
        return "weights"
    if key.startswith("rq:job:") or key.startswith("rq:execution"):
        return "rq_jobs"
    if (
        key.startswith(("rq:worker:", "rq:workers", f"{ns}:worker:", f"{ns}:presence"))
        or key == keys.workers()
    ):
        return "workers"
    if key.startswith("rq:"):
        return "rq_queues"  # queues, their registries, rq's housekeeping
    return "other"


@dataclass(slots=True)
class Inventory:
    keys: Counter[str] = field(default_factory=Counter)  # category -> keys
    bytes: Counter[str] = field(default_factory=Counter)  # category -> MEMORY USAGE
    samples: dict[str, list[str]] = field(default_factory=dict)  # category -> a few keys
    names: dict[str, list[str]] = field(default_factory=dict)  # category -> its keys (capped)
    info: dict[str, int] = field(default_factory=dict)  # INFO memory and clients (figures)

    @property
    def comparable(self) -> int:
        """The keyspace's bytes without the kinds that grow by design."""
        return sum(n for c, n in self.bytes.items() if c not in GROW_BY_DESIGN)

    def figures(self) -> dict[str, Any]:
        return {
            "keyspace_bytes": sum(self.bytes.values()),
            "comparable_bytes": self.comparable,
            "keys": dict(self.keys),
            "bytes": dict(self.bytes),
            "info": self.info,
        }


async def inventory(redis: Redis) -> Inventory:
    await redis.memory_purge()
    names = [k.decode() async for k in redis.scan_iter(count=_SCAN_COUNT)]
    async with redis.pipeline(transaction=False) as pipe:
        for k in names:
            pipe.memory_usage(k, samples=0)
        pipe.info("memory")
        pipe.info("clients")
        *sizes, info, clients = await pipe.execute()
    inv = Inventory(info={k: int(info[k]) for k in INFO_FIELDS if k in info})
    inv.info["connected_clients"] = int(clients["connected_clients"])
    for k, size in zip(names, sizes, strict=True):
        c = category(k)
        inv.keys[c] += 1
        inv.bytes[c] += int(size or 0)
        if len(inv.samples.setdefault(c, [])) < 5:
            inv.samples[c].append(k)
        if len(inv.names.setdefault(c, [])) < NAMES_KEPT:
            inv.names[c].append(k)
    jobs = [k for k in inv.samples.get("rq_jobs", []) if k.startswith("rq:job:")]
    if jobs:
        # Name what a left-over job was: its rq status and its rollout.
        async with redis.pipeline(transaction=False) as pipe:
            for k in jobs:
                pipe.hmget(k, ["status", "description"])
            described = await pipe.execute()
        for k, (status, what) in zip(jobs, described, strict=True):
            i = inv.samples["rq_jobs"].index(k)
            inv.samples["rq_jobs"][i] = f"{k} ({_text(status)}: {_text(what)})"
    return inv


def _text(value: bytes | None) -> str:
    return "-" if value is None else value.decode(errors="replace")


def judge(before: Inventory, after: Inventory) -> list[str]:
    """What keeps Redis from its baseline; empty when it is back."""
    problems = [
        f"{after.keys[c]} {c} keys left (e.g. {', '.join(after.samples.get(c, []))})"
        for c in MUST_BE_GONE
        if after.keys[c]
    ]
    if after.comparable > before.comparable + KEYSPACE_SLACK_BYTES:
        grown = {
            c: after.bytes[c] - before.bytes[c]
            for c in after.bytes
            if after.bytes[c] > before.bytes[c] and c not in GROW_BY_DESIGN
        }
        # Name a few keys of each kind that grew, with their TTLs, so a report says what they
        # are (a 30-minute soak left 61 rq keys once, and its report could not say which).
        named = {c: sorted(set(after.names.get(c, [])) - set(before.names.get(c, [])))[:5]
                 for c in grown}  # fmt: skip
        problems.append(
            f"keyspace {after.comparable} bytes, baseline {before.comparable}; "
            f"grown by kind: {grown}; e.g. {named}"
        )
    return problems
