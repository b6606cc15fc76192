"""Redis Cluster's slots, as the store places its keys in them.

A key's slot is CRC16 of its hash tag (what is inside its first ``{...}``) modulo 16384, so
every key of one rollout (tag: its id) lands in one slot, where one script may touch them all.
What a rollout's append also writes beside its own keys (the deployment's counters, the
completion outbox) must be in that slot too: each slot gets companion keys whose tag is a
short string chosen to hash to it (``slot_tag``), which is how the counters are spread over
every master instead of standing on one (``docs/cluster-plan.md``, section 4).
"""

from __future__ import annotations

from functools import cache
from urllib.parse import urlsplit

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

SLOTS = REDIS_CLUSTER_HASH_SLOTS
CLUSTER_SCHEME = "redis+cluster"
_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"

__all__ = ["CLUSTER_SCHEME", "SLOTS", "cluster_nodes", "is_cluster_url", "key_slot", "slot_tag"]


def _base36(n: int) -> str:
    out = ""
    while True:
        n, d = divmod(n, 36)
        out = _DIGITS[d] + out
        if not n:
            return out


@cache
def _tags() -> tuple[str, ...]:
    """For every slot, the first base-36 numeral whose CRC16 lands on it (~170k tries, all
    slots reached by numerals of at most 4 characters; ~0.5 s, once per process)."""
    tags: list[str | None] = [None] * SLOTS
    missing, n = SLOTS, 0
    while missing:
        tag = _base36(n)
        slot = key_slot(tag.encode())
        if tags[slot] is None:
            tags[slot] = tag
            missing -= 1
        n += 1
    return tuple(t for t in tags if t is not None)


def slot_tag(slot: int) -> str:
    """A hash tag that lands on ``slot``: ``f"x:{{{slot_tag(s)}}}"`` is a key of slot s."""
    return _tags()[slot]


def is_cluster_url(url: str) -> bool:
    return url.split("://", 1)[0].lower() == CLUSTER_SCHEME


def cluster_nodes(url: str) -> list[tuple[str, int]]:
    """The startup nodes of a ``redis+cluster://[user:password@]host:port[,host:port...]``
    URL. Any one node is enough for the client to find the rest; more ride out one being down
    at start (redis-py's ``startup_nodes``)."""
    netloc = urlsplit(url).netloc.rpartition("@")[2]
    nodes = []
    for part in netloc.split(","):
        host, _, port = part.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"a cluster URL lists host:port pairs, got {part!r}")
        nodes.append((host.strip("[]"), int(port)))
    return nodes
