"""The weight-version registry: a durable, append-only log of published checkpoints.

A trainer publishes ``(version, path)``; versions only go up (the script refuses an older or
equal one, comparing them exactly). A version is at most ``MAX_VERSION``: every token records
the version that sampled it in an int64 array. Workers learn of a new version at once by a
blocking ``XREAD`` on the log: no polling, and a worker that was down simply reads what it
missed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from store import scripts
from store.errors import StoreError
from store.keys import Keys

# The largest version: tokens carry theirs as int64 (and the log's entry ids could hold no
# more than 2^64 - 1).
MAX_VERSION = 2**63 - 1


class StaleWeightVersion(StoreError, ValueError):
    """A publish of a version that is not above the latest one; nothing was recorded."""


@dataclass(frozen=True, slots=True)
class WeightVersion:
    version: int
    path: str
    at: float


class WeightRegistry:
    def __init__(self, client: Redis, keys: Keys | None = None) -> None:
        self.redis = client
        self.key = (keys or Keys()).weights()

    async def publish(self, version: int, path: str) -> WeightVersion:
        if (
            isinstance(version, bool)
            or not isinstance(version, int)
            or not 1 <= version <= MAX_VERSION
        ):
            raise StaleWeightVersion(
                f"weight version must be an int in [1, {MAX_VERSION}], got {version!r}"
            )
        if not isinstance(path, str) or not path:
            raise ValueError("weight path must be a non-empty string")
        now = time.time()
        reply = await scripts.PUBLISH_WEIGHTS(
            self.redis, [self.key], [str(version), path, repr(now)]
        )
        if reply[0] == b"dup":  # retried as it was: the first publish's answer
            return WeightVersion(version, path, float(reply[1]))
        if reply[0] == b"old":
            raise StaleWeightVersion(
                f"weight version {version} is not above the latest published ({int(reply[1])})"
            )
        return WeightVersion(version, path, now)

    async def latest(self) -> WeightVersion | None:
        entries = await self.redis.xrevrange(self.key, count=1)
        return _parse(entries[0]) if entries else None

    async def history(self) -> list[WeightVersion]:
        return [_parse(e) for e in await self.redis.xrange(self.key)]

    async def wait_newer(self, version: int, timeout_s: float) -> WeightVersion | None:
        """Block until a version above ``version`` exists (the newest is returned), or None."""
        reply = await self.redis.xread(
            {self.key: f"0-{version}"}, block=max(1, int(timeout_s * 1000))
        )
        if not reply:
            return None
        entries = reply[0][1]
        return _parse(entries[-1])


def _parse(entry: Any) -> WeightVersion:
    entry_id, fields = entry
    return WeightVersion(
        version=int(entry_id.split(b"-")[1]),
        path=fields[b"path"].decode(),
        at=float(fields[b"at"]),
    )
