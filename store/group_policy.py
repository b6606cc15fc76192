"""What a failed sample does to its group: under ``GroupPolicy.GROUP`` the samples of its group
that have not ended are cancelled (a group with a hole is useless to a GRPO trainer, so their
generation would only waste the fleet). Here, not in the worker, because an episode fails on
the environment's side too (``env_fatal``, retries spent, an unverified effect of a
``restart`` tool: ``store.tool_sweep``, ``store.environment``) and must do the same to its
group as a generation failure does (``workers.failures.record_failure``)."""

from __future__ import annotations

import logging

from statemachine import GroupPolicy, RolloutState
from store.batches import info_async
from store.event_store import EventStore
from store.lifecycle import cancel

log = logging.getLogger("rollouts.failures")


async def cancel_siblings(store: EventStore, failed: RolloutState) -> list[str]:
    """Under ``GroupPolicy.GROUP``, cancel the other samples of a failed rollout's group that
    have not ended (their saved tokens stay). Returns the ids cancelled. Best effort: a Redis
    error is logged, not raised, as the failure itself is recorded and the trainer sees it."""
    m = failed.membership
    if m.group_policy is not GroupPolicy.GROUP or not m.batch_id or m.group_size < 2:
        return []
    try:
        info = await info_async(store.redis, store.keys, m.batch_id)
        if info is None:
            return []  # the batch was acknowledged or expired: nothing left to cancel
        siblings = [rid for rid in info.group_ids(m.group_index) if rid != failed.rollout_id]
        kind = failed.failure.value if failed.failure is not None else "failed"
        why = f"group policy: sibling {failed.rollout_id} failed ({kind}: {failed.error})"
        cancelled = await cancel(store, siblings, why, refuse_ended=False)
    except Exception:
        # Redis unreachable (a sibling acknowledged already is skipped, not an error): the
        # siblings run on; the trainer still sees this sample's failure.
        log.warning("rollout %s: cannot cancel its group", failed.rollout_id, exc_info=True)
        return []
    if cancelled:
        log.info("rollout %s failed: cancelled its group's %s", failed.rollout_id, cancelled)
    return cancelled
