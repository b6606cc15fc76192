"""Redis-backed storage: the fenced event store, keys, leases, the rq queue, and the trainer API."""

from __future__ import annotations

from store.errors import (
    AppendRefused,
    InvalidRolloutId,
    RolloutExists,
    RolloutNotFound,
    SequenceConflict,
    StaleAttempt,
    StoreError,
    StoreUnwritable,
)
from store.event_store import EventStore
from store.keys import Keys

__all__ = [
    "AppendRefused",
    "EventStore",
    "InvalidRolloutId",
    "Keys",
    "RolloutExists",
    "RolloutNotFound",
    "SequenceConflict",
    "StaleAttempt",
    "StoreError",
    "StoreUnwritable",
]
