"""Delivering ended rollouts in completion order, pushed by Redis rather than polled.

The append that ends a rollout also adds an entry to its batch's completion stream, in the same
script (``lua/append.lua``). A reader blocks on that stream (``XREAD BLOCK``) from a position:
every rollout that ends after the position is delivered exactly once, in the order it ended,
and a reader that restarts resumes from the last position it handled (or from the start, where
the rollouts it acknowledged are gone). The stream is persisted like every other write (AOF),
so a Redis restart loses no completion; the reader's connection retries through it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from dataclasses import dataclass

from redis.asyncio import Redis

from statemachine import Status
from store import defaults
from store.errors import StoreError
from store.keys import Keys

START = "0-0"
# How many quiet blocks pass between checks for awaited rollouts deleted elsewhere (one
# pipelined EXISTS per awaited rollout): the first quiet block, then every 5th.
GONE_CHECK_EVERY = 5


class WaitTimeout(StoreError, TimeoutError):
    """Gave up before every rollout waited for ended; the rollouts carry on regardless."""


@dataclass(frozen=True, slots=True)
class Completion:
    position: str  # the entry's id in the stream: resume after it
    rollout_id: str
    status: Status


async def follow(
    redis: Redis,
    keys: Keys,
    batch_id: str,
    wanted: Collection[str],
    *,
    after: str = START,
    timeout: float | None = None,
    gone: Callable[[list[str]], Awaitable[Collection[str]]] | None = None,
) -> AsyncIterator[list[Completion]]:
    """Yield the completions of the rollouts in ``wanted`` after ``after``, a block at a time
    as they arrive, until every one was delivered. Others in the stream are skipped.

    ``gone`` (optional) is asked, when the stream stays quiet for a while, which of the
    rollouts still awaited no longer exist (acknowledged or expired elsewhere): they will
    never complete, so they are no longer awaited."""
    remaining = set(wanted)
    key = keys.completions(batch_id)
    position = after
    deadline = None if timeout is None else time.monotonic() + timeout
    quiet = 0
    while remaining:
        block_ms = defaults.COMPLETION_BLOCK_MS
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WaitTimeout(f"{len(remaining)} of {len(wanted)} rollouts still running")
            block_ms = max(1, min(block_ms, int(left * 1000)))
        reply = await redis.xread({key: position}, count=512, block=block_ms)
        if not reply:
            quiet += 1
            if gone is not None and quiet % GONE_CHECK_EVERY == 1:
                remaining -= set(await gone(sorted(remaining)))
            continue
        block = []
        for entry_id, fields in reply[0][1]:
            position = entry_id.decode()
            rid = fields[b"r"].decode()
            if rid in remaining:
                remaining.discard(rid)
                block.append(Completion(position, rid, Status(fields[b"s"].decode())))
        if block:
            yield block


async def delivered_before(redis: Redis, keys: Keys, batch_id: str, position: str) -> set[str]:
    """The rollouts whose completions sit at or before ``position`` (handled by a reader that
    re-attaches after it)."""
    if position == START:
        return set()
    entries = await redis.xrange(keys.completions(batch_id), "-", position)
    return {fields[b"r"].decode() for _, fields in entries}
