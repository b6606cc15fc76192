"""Delivering ended rollouts in completion order, pushed by Redis rather than polled.

The append that ends a rollout also adds an entry to its batch's completion stream, in the same
script (``lua/append.lua``). A reader blocks on that stream (``XREAD BLOCK``) from a position:
every rollout that ends after the position is delivered exactly once, in the order it ended,
and a reader that restarts resumes from the last position it handled (or from the start, where
the rollouts it acknowledged are gone). The stream is persisted like every other write (AOF),
so a Redis restart loses no completion; the reader's connection retries through it.
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from statemachine import TERMINAL, Status
from store import defaults
from store.errors import StoreError
from store.keys import Keys

START = "0-0"
# How many quiet blocks pass between checks for awaited rollouts deleted elsewhere (one
# pipelined EXISTS per awaited rollout): the first quiet block, then every 5th.
GONE_CHECK_EVERY = 5


class WaitTimeout(StoreError, TimeoutError):
    """Gave up before every rollout waited for ended; the rollouts carry on regardless."""


class UnknownPosition(StoreError, ValueError):
    """``after`` is no position of the batch's results: not an entry of its completion
    stream, nor one that could have been acknowledged since. Nothing was read."""


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
    turns: bool = False,
) -> AsyncIterator[list[Completion]]:
    """Yield the completions of the rollouts in ``wanted`` after ``after``, a block at a time
    as they arrive, until every one was delivered. Others in the stream are skipped.

    ``gone`` (optional) is asked, when the stream stays quiet for a while, which of the
    rollouts still awaited no longer exist (acknowledged or expired elsewhere): they will
    never complete, so they are no longer awaited.

    ``turns``: deliver a harness turn's end too (an episode's first call waits on its batch's
    stream for the end of the first turn: ``store.harness_turns``); without it only ends of
    rollouts are delivered, and such entries are skipped."""
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
            status = Status(fields[b"s"].decode())
            if rid in remaining and (turns or status in TERMINAL):
                remaining.discard(rid)
                block.append(Completion(position, rid, status))
        if block:
            yield block


_POSITION = re.compile(r"\d{1,20}-\d{1,20}")


def _id(position: str | bytes) -> tuple[int, int]:
    ms, seq = (position.decode() if isinstance(position, bytes) else position).split("-")
    return int(ms), int(seq)


async def check_position(redis: Redis, keys: Keys, batch_id: str, position: str) -> None:
    """Refuse (``UnknownPosition``) a position that is not one of the batch's results.

    A position is an entry of the batch's completion stream (``START`` aside). An ack deletes
    its rollout's entry, and a trainer that acknowledged what it handled resumes after the
    last position it handled: so a position that is no entry now is still taken if it may
    have been one, i.e. it is at or below the stream's highest deleted entry (Redis keeps
    that id, ``max-deleted-entry-id``, since 7.0). What is refused: a position past the
    stream's last entry (another batch's, made up, or a typo), one where nothing was ever
    deleted, and any position of a batch with no stream yet. A made-up position between
    deleted ones cannot be told from a deleted one; it is taken for what it says, a point
    in the batch's completion order."""
    if position == START:
        return
    problem = f"after: {position!r} is not a position of batch {batch_id!r}'s results"
    if not isinstance(position, str) or _POSITION.fullmatch(position) is None:
        raise UnknownPosition(f"{problem} (a position is <ms>-<seq>, from a result)")
    key = keys.completions(batch_id)
    if await redis.xrange(key, position, position, count=1):
        return
    try:
        info = await redis.xinfo_stream(key)
    except ResponseError:  # no such key: no rollout of the batch has ended yet
        raise UnknownPosition(f"{problem}: none of its rollouts has ended") from None
    deleted = info.get("max-deleted-entry-id")
    if deleted is not None and _id(position) <= _id(deleted):
        return
    raise UnknownPosition(f"{problem}; pass a result's position, or none for the start")


async def delivered_before(redis: Redis, keys: Keys, batch_id: str, position: str) -> set[str]:
    """The rollouts whose completions sit at or before ``position`` (handled by a reader that
    re-attaches after it)."""
    if position == START:
        return set()
    # A page at a time: one XRANGE of a 100,000-entry stream would hold Redis for all of it.
    found: set[str] = set()
    start = "-"
    while True:
        entries = await redis.xrange(
            keys.completions(batch_id), start, position, count=defaults.BULK_CHUNK
        )
        found.update(fields[b"r"].decode() for _, fields in entries)
        if len(entries) < defaults.BULK_CHUNK:
            return found
        start = "(" + entries[-1][0].decode()  # exclusive: after the last one read
