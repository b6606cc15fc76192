"""What ``RolloutClient.wait`` follows: the rollouts still running, by batch, each batch's
completion stream then followed from its start (``store.completions``)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from statemachine import RolloutState
from store import lifecycle
from store.errors import RolloutNotFound
from store.event_store import EventStore
from store.submission import Batch


async def by_batch(store: EventStore, ids: Sequence[str], order: list[str]) -> dict[str, list[str]]:
    """The rollouts of ``order`` still running, by batch. A fresh batch's are all of them:
    every one of its rollouts that ends adds to its stream, which nothing else wrote before
    them (the batch was created by the submit that returned it)."""
    if isinstance(ids, Batch) and ids.fresh:
        return {ids.batch_id: order}
    by_batch: dict[str, list[str]] = defaultdict(list)
    for rid, h in zip(order, await lifecycle.heads(store, order), strict=True):
        if isinstance(h, RolloutNotFound):
            raise h
        if isinstance(h, RolloutState) and not h.terminal:
            by_batch[h.membership.batch_id].append(rid)
    return by_batch
