"""Operations on many rollouts go to Redis in chunks, so that none holds it for long.

Redis runs one script or MULTI/EXEC at a time, and nothing else meanwhile: a cancel of a
100,000-rollout batch sent as one transaction held it for 7.3 s (issue 28), longer than a
lease's TTL, and no worker's renewal was answered until it ended. So every operation over
many rollouts (cancel and ``take=k``'s cancel of the rest, ack, the reads of ``wait``,
``results``, ``rollouts stuck`` and ``rollouts requeue``) sends ``defaults.BULK_CHUNK`` of
them per round trip (a transaction, or a pipeline of one-rollout scripts), a chunk at a time:
other clients' commands run between two chunks. Loads, which read whole logs, go
``LOAD_CHUNK`` at a time, and a submit in chunks of its own (``SUBMIT_CHUNK``, bounded in
bytes too).

What that gives up is a bulk operation's atomicity as a whole; each rollout's own step (its
append, its ack) is as atomic as before, and so is each chunk. An operation interrupted for
good (its client killed, Redis gone past the retries) has done whole chunks and none of the
rest, and a reader sees a batch's cancels arrive chunk by chunk rather than at one instant.
Neither breaks a promise the operations make. Each is idempotent per rollout, so repeating
one finishes it: a batch's or a group's cancel skips what has ended, an ack reports what is
gone as missing; a cancel of named ids refuses ended ones before writing anything, naming them
(``RolloutEnded.ended``), so it is repeated without them (as ``rollouts cancel`` does). A chunk
retried after a lost reply is recognised as done (``lua/append.lua`` answers a repeated record
"dup"). And a batch's cancel was never a snapshot: its rollouts end on their own meanwhile.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TypeVar

from store import defaults

T = TypeVar("T")


def chunks(items: Sequence[T], size: int = defaults.BULK_CHUNK) -> Iterator[Sequence[T]]:
    """``items`` in consecutive slices of at most ``size``."""
    if size < 1:
        raise ValueError(f"chunk size must be >= 1, got {size}")
    for start in range(0, len(items), size):
        yield items[start : start + size]
