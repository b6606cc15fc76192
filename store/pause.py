"""The deployment's pause: a harness's ``POST /pause?mode=...`` (SkyRL's control plane) as one
Redis key that says workers should admit no new rollouts until ``/resume`` deletes it.

Only the record lives here (store never imports workers). Every worker reads it with its
stats heartbeat (``store.stats.beat``, the same round trip) and follows it
(``workers.pausing``); a plain key, so it survives a Redis restart with the AOF like the
rollouts it holds back.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis.asyncio as aredis

from store.keys import Keys

MODES = ("keep", "abort", "wait")


@dataclass(frozen=True, slots=True)
class Pause:
    mode: str
    at: float  # unix seconds, this host's clock

    @classmethod
    def decode(cls, raw: dict[bytes, bytes]) -> Pause | None:
        """The pause an HGETALL of the key read (None: absent, workers admit)."""
        if not raw:
            return None
        return cls(raw[b"mode"].decode(), float(raw[b"at"]))


class PauseFlag:
    def __init__(self, client: aredis.Redis, keys: Keys | None = None) -> None:
        self.redis = client
        self.key = (keys or Keys()).paused()

    async def pause(self, mode: str) -> Pause:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        # A pause already held keeps its start (a second /pause, or SkyRL calling each of
        # several API processes, changes only the mode): what workers report holding, and what
        # a waiting /pause?mode=wait compares, stays one pause.
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hsetnx(self.key, "at", repr(time.time()))
            pipe.hset(self.key, "mode", mode)
            pipe.hget(self.key, "at")
            *_, at = await pipe.execute()
        return Pause(mode, float(at))

    async def resume(self) -> None:
        await self.redis.delete(self.key)

    async def current(self) -> Pause | None:
        return Pause.decode(await self.redis.hgetall(self.key))  # type: ignore[misc]
